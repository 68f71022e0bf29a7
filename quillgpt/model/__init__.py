"""The model: a decoder-only GPT (gpt), the shared attention math (attention), the static KV cache
(kv_cache) and the attention variants (variants/). Knows nothing of files, tokenizers or training."""
