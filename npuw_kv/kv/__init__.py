"""KV cache storage: the shared per-layer buffers, their views and copies (no OpenVINO models here)."""
