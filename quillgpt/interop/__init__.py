"""Other formats: the family table (families), Hugging Face directories (convert: import-hf and
export-hf; hf_files: reading them) through each shape's codec (gpt2, llama)."""
