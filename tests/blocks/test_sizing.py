"""Sizing: ``min_live_blocks`` in closed form (equal to the per-start maximum, at any
``max_seq_len``, a bound on every chunking) and the promise the size check makes with it."""

from __future__ import annotations

import random
import time
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npuw_kv.kv.blocks import (
    BlockManagerConfig,
    ChunkTooLargeError,
    KVBlockManager,
    LayerSpec,
    uniform_layers,
)
from npuw_kv.kv.blocks.sequence import (
    blocks_for,
    detached_after,
    live_after_call,
    min_live_blocks,
)

pytestmark = pytest.mark.unit  # builds no model (the quick tier)


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
        mgr = KVBlockManager(cfg)
        mgr.add_sequence("a", list(range(64)))
        for i in range(20):
            mgr.add_tokens("a", list(range(i, i + 64)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    mgr.check_invariants()
    assert peak < 4 << 20, f"{peak} bytes traced"


def test_a_budget_the_check_accepts_fits_one_max_seq_len_prompt() -> None:
    """33 SWA blocks is what one 4096-token prompt needs in calls of 512 tokens: a budget that
    holds exactly that is accepted and the chunked protocol fits it; a larger call is refused
    with the reason, not blamed on live sequences."""
    tpb, length, window = 32, 4096, 512
    bpb = 2 * 64 * 2 * tpb  # bytes per block of one layer (1 head, dim 64, fp16)
    swa, full = min_live_blocks(length, window, tpb, 512), length // tpb
    assert (swa, full) == (33, 128)
    cfg = BlockManagerConfig(
        [LayerSpec(window, 1, 64), LayerSpec(None, 1, 64)],
        max_seq_len=length,
        kv_budget_bytes=(swa + full) * bpb + bpb // 2,  # + slack for the float shares
        tokens_per_block=tpb,
        window_size_shares=[swa / (swa + full), full / (swa + full)],
    )
    mgr = KVBlockManager(cfg)
    assert {w: g.primary_blocks for w, g in mgr.groups.items()} == {512: 33, 4096: 128}
    prompt = list(range(1000))
    with pytest.raises(ChunkTooLargeError, match="1000 tokens .* max_tokens_per_call is 512"):
        mgr.add_sequence("a", prompt)
    assert mgr.stats().live_sequences == 0 and mgr.stats().prompt_tokens == 0
    with pytest.raises(ChunkTooLargeError, match="add_tokens.*600 tokens"):
        mgr.add_sequence("b", [1])
        mgr.add_tokens("b", list(range(600)))
    mgr.remove_sequence("b")
    mgr.add_sequence("a", prompt[:512])  # the documented chunked protocol fits
    for start in range(512, length, 512):
        mgr.add_tokens("a", list(range(start, start + 512)))
    assert mgr.num_tokens("a") == length
    mgr.check_invariants()


@settings(max_examples=150, deadline=None)
@given(
    length=st.integers(1, 48),
    tpb=st.integers(1, 5),
    chunk=st.integers(1, 20),
    data=st.data(),
)
def test_min_live_blocks_bounds_every_chunking(
    length: int, tpb: int, chunk: int, data: st.DataObject
) -> None:
    """min_live_blocks is an upper bound over every way to add calls of <= chunk tokens
    (and every hit start), and some chunking reaches it."""
    window = data.draw(st.integers(1, length))
    bound = min_live_blocks(length, window, tpb, chunk)
    start = data.draw(st.integers(0, length - 1)) // tpb * tpb  # a prefix hit, whole blocks
    detached = max(0, (start + 1 - window) // tpb) if start else 0
    n, peak = start, 0
    while n < length:
        step = data.draw(st.integers(1, min(chunk, length - n)))
        peak = max(peak, live_after_call(n, n + step, window, tpb, detached))
        detached = max(detached, (n + 1 - window) // tpb)
        n += step
    assert peak <= bound
    reach = max(
        live_after_call(m, min(m + chunk, length), window, tpb, max(0, (m + 1 - window) // tpb))
        for m in range(length)
    )
    assert reach == bound
