"""Text to tokens: reading a corpus (corpus), tokenizers (tokenizer), downloads (download), token
shards and their manifest (prepare, shards), and batches of windows for training (batches).
Knows nothing of the model; torch only where batches are made."""
