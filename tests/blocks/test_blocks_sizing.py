"""``min_live_blocks`` in closed form: equal to the per-start maximum, at any ``max_seq_len``."""

from __future__ import annotations

import random
import time
import tracemalloc

from npuw_kv.kv.blocks import BlockManagerConfig, KVBlockManager, uniform_layers
from npuw_kv.kv.blocks.sequence import blocks_for, detached_after, min_live_blocks


def _reference(max_seq_len: int, window: int, tpb: int, chunk: int) -> int:
    """The definition: the peak over every start ``n`` of a call of at most ``chunk`` tokens."""
    c = max(1, chunk)
    return max(
        blocks_for(min(n + c, max_seq_len), tpb) - detached_after(n + 1, window, tpb, 0)
        for n in range(max_seq_len)
    )


def test_min_live_blocks_equals_the_per_start_maximum() -> None:
    rng = random.Random(7)
    for _ in range(20_000):
        length = rng.randint(1, rng.choice([6, 40, 300]))
        window, tpb = rng.randint(1, length), rng.randint(1, rng.choice([3, 40]))
        chunk = rng.randint(0, length + 3)
        args = (length, window, tpb, chunk)
        assert min_live_blocks(*args) == _reference(*args), args


def test_min_live_blocks_needs_no_per_token_memory() -> None:
    tracemalloc.start()
    try:
        assert min_live_blocks(5 * 10**7, 512, 32, 512) == 33
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, f"{peak} bytes traced for a 5e7-token bound"
    start = time.perf_counter()
    assert min_live_blocks(10**12, 512, 32, 512) == 33
    assert min_live_blocks(10**12, 10**12, 32, 512) == 10**12 // 32
    assert time.perf_counter() - start < 0.1


def test_a_huge_max_seq_len_costs_only_the_blocks_in_use() -> None:
    """Sliding windows only: pools follow the budget, tables the tokens actually added."""
    cfg = BlockManagerConfig(
        layers=uniform_layers([64, 128, 256], 1, 4),
        max_seq_len=10**12,
        kv_budget_bytes=3 << 16,  # 256 blocks a window
        tokens_per_block=16,
        max_tokens_per_call=64,
    )
    tracemalloc.start()
    try:
        mgr = KVBlockManager(cfg, env={})
        mgr.add_sequence("a", list(range(64)))
        for i in range(20):
            mgr.add_tokens("a", list(range(i, i + 64)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    mgr.check_invariants()
    assert peak < 4 << 20, f"{peak} bytes traced"
