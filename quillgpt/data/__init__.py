"""Text to tokens: reading a corpus (corpus), tokenizers (tokenizer: char, tiktoken, BPE;
hf_tokenizer: a Hugging Face tokenizer.json; tokenizer_files: any kind from its name, spec or
file), chat templates (chat_template) and chat data (chat_data), downloads (download), token
shards and their manifest (prepare, shards), and every batch sampler (batches: windows;
chat_batches: conversations; prefix_batches: a prefix-LM's prefixes). Knows nothing of the model;
torch only where batches are made."""
