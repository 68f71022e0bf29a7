"""QuillGPT: a small, fast, honest GPT toolkit."""

__version__ = "0.1.0"
