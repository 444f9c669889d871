"""Shared builders for the block-manager tests (a plain module: ``conftest`` names clash)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from npuw_kv.kv.blocks import BlockManagerConfig, KVBlockManager, LayerSpec


def build(
    windows: Sequence[int | None],
    blocks: Sequence[int],
    *,
    max_seq_len: int = 32,
    tpb: int = 2,
    host: Sequence[int] | None = None,
    **kwargs: object,
) -> KVBlockManager:
    """Manager with one layer (1 kv head, head_dim 1, fp16: 4 bytes/token) per window.

    ``blocks``/``host`` give the exact primary/host block count per window, in ascending
    window order (None = full attention = max_seq_len, i.e. last).
    """
    block_bytes = 4 * tpb
    total = sum(blocks)
    host = host or [0] * len(blocks)
    host_total = sum(host)
    cfg = BlockManagerConfig(
        layers=[LayerSpec(w, 1, 1) for w in windows],
        max_seq_len=max_seq_len,
        kv_budget_bytes=total * block_bytes + block_bytes // 2,
        host_budget_bytes=host_total * block_bytes + (block_bytes // 2 if host_total else 0),
        tokens_per_block=tpb,
        window_size_shares=[b / total for b in blocks],
        **kwargs,  # type: ignore[arg-type]
    )
    mgr = KVBlockManager(cfg, env={})
    for g, b in zip(mgr.groups.values(), blocks, strict=True):
        assert g.primary_blocks == b
    if host_total:
        for g, h in zip(mgr.groups.values(), host, strict=True):
            assert g.host_blocks == h, (g.window, g.host_blocks, h)
    return mgr


def fill_rows(mgr: KVBlockManager, seq_id: object, start: int, stop: int, seed: int) -> None:
    """Write distinct bytes into rows [start, stop) of every window, like a runtime would."""
    rng = np.random.default_rng(seed)
    for w, g in mgr.groups.items():
        table = mgr.block_table(seq_id, w)
        store = mgr.storage(w)
        for p in range(start, stop):
            slot = table[p // g.tokens_per_block]
            store[slot, p % g.tokens_per_block] = rng.integers(0, 256, g.bytes_per_token)


def rows(mgr: KVBlockManager, seq_id: object, window: int, start: int, stop: int) -> np.ndarray:
    g = mgr.groups[window]
    table = mgr.block_table(seq_id, window)
    store = mgr.storage(window)
    return np.stack(
        [store[table[p // g.tokens_per_block], p % g.tokens_per_block] for p in range(start, stop)]
    )
