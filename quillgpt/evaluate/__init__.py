"""Looking at a model: scores over a text or split (scores: quill eval), attention weights and head
statistics (attention_views: quill attention), loss curves (curves: quill plot), and matplotlib
without global state (figures)."""
