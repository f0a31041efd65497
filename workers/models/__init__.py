"""Model implementations (our own modules) and weight loading (GGUF via transformers, safetensors)."""
