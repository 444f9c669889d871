"""Earlier prompts' KV kept on the host, in whole blocks, for the static-shape path.

The static-shape cache holds one sequence: a prompt can continue only the last one (a chat).
NPUW's answer is a prefix cache of chunk-sized blocks restored into the past before the chunk
loop; ours is the block manager (``kv/blocks``) with its numpy store: when a prompt starts, the
previous sequence's whole blocks are copied from the shared buffer into the store (those not
there yet), and a prompt whose longest cached prefix saves chunks gets those blocks copied back
into its slots.  A memcpy of a block costs microseconds; recomputing it, a prefill chunk.

Only one sequence is ever live in the manager (added, its bytes copied, removed again), so its
pool is just the store: ``tokens`` of KV (whole blocks), the longest prefix it can hold too,
plus one block for the partial block a restore claims beside the prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ...config.settings import STORE_BLOCK_TOKENS
from ...kv.blocks import BlockManagerConfig, KVBlockManager, LayerSpec
from ...kv.cache import SharedKVCache
from ...kv.copy import CopyCounter
from ...kv.memory import ensure_fits
from ...model.layout import KVLayout


class HostPrefixCache:
    """A block store of up to ``tokens`` tokens of KV, keyed by the tokens (radix tree)."""

    def __init__(
        self, cache: SharedKVCache, layout: KVLayout, tokens: int, counter: CopyCounter
    ) -> None:
        """``counter``: where the bytes copied to and from the store are counted."""
        tpb = STORE_BLOCK_TOKENS
        self.capacity = tokens // tpb * tpb  # whole blocks only
        if self.capacity < tpb:
            raise ValueError(
                f"prefix_cache_tokens={tokens} holds no block of {tpb} tokens; give at least {tpb}"
            )
        self.cache = cache
        # (K buffer, V buffer) of every layer, in layer order, and its shape
        keys = {p.layer: p for p in layout.ports if p.kind == "key"}
        values = {p.layer: p for p in layout.ports if p.kind == "value"}
        specs = []
        for i in sorted(keys):
            k, v = keys[i], values[i]
            if (k.num_heads, k.head_dim) != (v.num_heads, v.head_dim):
                raise ValueError(
                    f"layer {i}: K and V differ in shape; prefix_cache_tokens on the static-shape "
                    "path needs them alike (set it to 0)"
                )
            specs.append(LayerSpec(None, k.num_heads, k.head_dim))
        self._layers = [(keys[i].input_name, values[i].input_name) for i in sorted(keys)]
        per_token = sum(2 * s.num_kv_heads * s.head_dim for s in specs) * cache.dtype.itemsize
        slots = self.capacity + tpb
        ensure_fits(slots * per_token, f"a host prefix store of {slots} tokens")
        config = BlockManagerConfig(
            layers=specs,
            max_seq_len=slots,
            primary_blocks={slots: slots // tpb},
            tokens_per_block=tpb,
            dtype=cache.dtype.name,
            max_tokens_per_call=slots,
        )
        self._config = config
        self.blocks = KVBlockManager(config)
        self._window = next(iter(self.blocks.windows))
        self._seq = 0
        self.copied = counter

    def forget(self) -> None:
        """Drop every stored block (their KV no longer what the model computes: another
        LoRA adapter applies)."""
        self.blocks = KVBlockManager(self._config)
        self._seq = 0

    @property
    def nbytes(self) -> int:
        return int(self.blocks.storage(self._window).nbytes)

    @property
    def cached_tokens(self) -> int:
        return self.blocks.stats().windows[self._window].cached_blocks * STORE_BLOCK_TOKENS

    def lookup(self, ids: np.ndarray) -> int:
        """Tokens of ``ids`` whose KV the store holds (whole blocks, one token at least left)."""
        limit = max(0, min(len(ids) - 1, self.capacity))
        return self.blocks.lookup([int(t) for t in ids[:limit]], max_hit_tokens=limit).hit_tokens

    def save(self, tokens: Sequence[int], first_slot: int) -> None:
        """Copy the whole blocks of ``tokens`` (token i in slot ``first_slot + i``) that the
        store lacks into it; they stay cached for later prompts until evicted."""
        whole = min(len(tokens), self.capacity) // STORE_BLOCK_TOKENS * STORE_BLOCK_TOKENS
        if not whole:
            return
        tokens = [int(t) for t in tokens[:whole]]
        # all stored already: nothing to copy, and no slot taken from another prefix for a
        # block the tree has
        if self.blocks.lookup(tokens, max_hit_tokens=len(tokens)).hit_tokens == len(tokens):
            return
        self._seq += 1
        reused = self.blocks.add_sequence(self._seq, tokens)
        try:
            table = self.blocks.block_table(self._seq, self._window)
            for index in range(reused // STORE_BLOCK_TOKENS, len(table)):
                self._copy(table[index], first_slot + index * STORE_BLOCK_TOKENS, to_store=True)
        finally:
            self.blocks.remove_sequence(self._seq)

    def restore(self, ids: np.ndarray, hit: int, first_slot: int) -> None:
        """Copy the first ``hit`` tokens' KV (from :meth:`lookup`) into slots ``first_slot...``."""
        self._seq += 1
        reused = self.blocks.add_sequence(self._seq, [int(t) for t in ids[: hit + 1]])
        try:
            if reused != hit:
                raise RuntimeError(f"prefix store reused {reused} tokens, not {hit}")
            table = self.blocks.block_table(self._seq, self._window)
            for index in range(hit // STORE_BLOCK_TOKENS):
                self._copy(table[index], first_slot + index * STORE_BLOCK_TOKENS, to_store=False)
        finally:
            self.blocks.remove_sequence(self._seq)

    def _copy(self, block: int, slot: int, *, to_store: bool) -> None:
        stop = slot + STORE_BLOCK_TOKENS
        for layer, (k_name, v_name) in enumerate(self._layers):
            view = self.blocks.layer_view(self._window, block, layer)  # [tpb, 2, heads, dim]
            for kv, name in ((0, k_name), (1, v_name)):
                for a, b, _ in self.cache.pieces(name, slot, stop):  # cut at the block edges
                    # [heads, rows, dim], whichever layout the buffer holds (V transposed or not)
                    rows = self.cache.token_rows(name, a, b)
                    store = view[a - slot : b - slot, kv]
                    if to_store:
                        store[...] = rows.transpose(1, 0, 2)
                    else:
                        rows[...] = store.transpose(1, 0, 2)
                    self.copied.bytes += rows.nbytes
                    self.copied.copies += 1
