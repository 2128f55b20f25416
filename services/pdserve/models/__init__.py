"""A model's files, without torch: GGUF reading, tokenizers, chat templates, the conversion cache."""
