"""Model side: read IR/GGUF, rewrite graphs (stateless, static, fixes), discover KV layout.

Nothing here knows about requests or KV buffers; it hands compiled-ready ``ov.Model`` objects
and a :class:`~npuw_kv.model.layout.KVLayout` to the runtime.
"""
