"""File formats: the hybrid's config, GGUF and HF safetensors sources, dequantization, HF -> GGUF."""
