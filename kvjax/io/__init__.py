"""Model I/O: Hugging Face and GGUF import, kvjax checkpoints, conversion, tokenizers, named models and model sources."""
