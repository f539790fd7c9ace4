"""Checkpoint formats: reading safetensors, GGUF and state dicts, weight processing, tokenizers."""
