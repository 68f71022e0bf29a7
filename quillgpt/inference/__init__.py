"""Generation: sampling settings and filters (sampling), the static-KV-cache engine (engine) and
its plain reference (recompute), text on top of tokens and the one driver of an engine (text),
and the everyday entry points (generate)."""
