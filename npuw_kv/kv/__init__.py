"""KV cache storage: the shared per-layer buffers, their views and copies.

Nothing here knows about OpenVINO models (tensors only)."""
