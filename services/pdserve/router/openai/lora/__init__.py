"""LoRA adapters over HTTP: the routes that load and unload them (vLLM's shapes)."""
