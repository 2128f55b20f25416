"""Checkpoints: model config, safetensors and GGUF weights, dequantization, the GGUF conversion cache."""
