"""The static-shape path (NPU, and ``attention_backend="sdpa"`` on CPU): a prefill model run
chunk by chunk and a generate model run token by token over one shared KV buffer."""
