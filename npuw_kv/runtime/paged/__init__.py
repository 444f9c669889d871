"""The PagedAttention path (the CPU default): one dynamic model over a paged KV cache whose
blocks the block manager (:mod:`npuw_kv.kv.blocks`) places."""
