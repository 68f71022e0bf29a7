"""Hugging Face interop: reading model directories (hf_files) and GPT-2 import/export (gpt2)."""
