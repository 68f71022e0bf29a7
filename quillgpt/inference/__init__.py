"""Generation: the next-token draw (sampling; its settings are quillgpt/sampling_params.py), the
static-KV-cache engine (engine) and its plain reference (recompute), the one driver of an engine
that turns tokens into text (driver), the everyday entry points (generate) and `quill chat`'s
conversation (chat_session)."""
