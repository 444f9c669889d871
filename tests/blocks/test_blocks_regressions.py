"""Regressions from the review: stale SWA ownership, onboard ownership, per-call budget,
offload/onboard events, numpy priorities. Each test failed before its fix."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from blocks_helpers import (
    build,
    check_read_rows,
    check_tree_bytes,
    fingerprints,
    write_prefix_rows,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from npuw_kv.kv.blocks import (
    BlockManagerConfig,
    ChunkTooLargeError,
    ConfigError,
    KVBlockManager,
    LayerSpec,
    OutOfBlocksError,
    PoolKind,
    PriorityRange,
)
from npuw_kv.kv.blocks.sequence import live_after_call, min_live_blocks


class _Runtime:
    """Drives a manager like an engine: every call writes its rows, every read row is checked."""

    def __init__(self, mgr: KVBlockManager) -> None:
        self.mgr = mgr
        self.tokens: dict[object, list[int]] = {}

    def add(self, sid: object, tokens: list[int]) -> int:
        hit = self.mgr.add_sequence(sid, tokens)
        self.tokens[sid] = list(tokens)
        check_read_rows(self.mgr, sid, tokens, hit)
        write_prefix_rows(self.mgr, sid, tokens, hit)
        return hit

    def extend(self, sid: object, new: list[int]) -> None:
        n_old = len(self.tokens[sid])
        self.mgr.add_tokens(sid, new)
        self.tokens[sid] += new
        check_read_rows(self.mgr, sid, self.tokens[sid], n_old)
        write_prefix_rows(self.mgr, sid, self.tokens[sid], n_old)

    def add_chunked(self, sid: object, tokens: list[int], chunk: int) -> int:
        """The runtime protocol: look up, add a chunk after the hit, then chunk by chunk."""
        first = self.mgr.lookup(tokens).hit_tokens + chunk
        hit = self.add(sid, tokens[:first])
        for i in range(first, len(tokens), chunk):
            self.extend(sid, tokens[i : i + chunk])
        return hit

    def remove(self, sid: object) -> None:
        self.mgr.remove_sequence(sid)
        del self.tokens[sid]
        self.mgr.check_invariants()
        check_tree_bytes(self.mgr)


def _swa2(host: int = 0) -> KVBlockManager:
    """One SWA-2 layer, one token per block, 6 primary blocks (the reviewer's repro)."""
    cfg = BlockManagerConfig(
        [LayerSpec(2, 1, 1)],
        max_seq_len=16,
        kv_budget_bytes=6 * 4,
        host_budget_bytes=host * 4,
        tokens_per_block=1,
        max_tokens_per_call=5,
    )
    return KVBlockManager(cfg, env={})


def test_owner_reallocating_its_own_stale_detached_block_does_not_store_it() -> None:
    """X detaches cached block b, Y claims b and ends, X's own allocation takes b back and
    writes other tokens into it: X's old slot must not be stored (it held token 9's row)."""
    rt = _Runtime(mgr := _swa2())
    wm = mgr.windows[2]
    rt.add("s0", [1, 2, 3, 4])
    rt.remove("s0")
    assert rt.add("X", [1, 2, 3, 4, 5]) == 4
    b4 = wm.seqs[1].table[3]
    rt.extend("X", [6])  # b4 detached (kept: it is cached)
    assert rt.add("Y", [1, 2, 3, 4, 9]) == 4  # Y claims b4 (X's detached slot)
    rt.remove("Y")
    t = 7
    while b4 not in wm.seqs[1].live():  # X's own allocations cycle back to b4
        rt.extend("X", [t])
        t += 1
    assert wm.seqs[1].storable  # Y is gone: nobody to invalidate, the generation decides
    assert not wm.seqs[1].holds_bytes(3)  # X's old slot 3 went stale
    rt.remove("X")  # check_tree_bytes: every cached block holds its path's rows
    hit = rt.add("Z", [1, 2, 3, 4, 99])  # checks the rows the hit hands out
    assert hit == 0  # the node at depth 4 is hollow now


@settings(max_examples=200, deadline=None)
@given(
    tpb=st.sampled_from([1, 1, 2]),
    window=st.integers(2, 5),
    spare=st.integers(0, 2),
    prefix=st.integers(1, 4),
    grow=st.lists(st.integers(1, 3), min_size=1, max_size=12),
    default_priority=st.sampled_from([0, 35, 100]),
    host=st.sampled_from([0, 4]),
)
def test_claimed_detached_blocks_are_never_stored_stale(
    tpb: int,
    window: int,
    spare: int,
    prefix: int,
    grow: list[int],
    default_priority: int,
    host: int,
) -> None:
    """The class of the first test, generalised: X hits a cached prefix and outgrows it, Y
    claims X's detached blocks and ends, X keeps writing until its own allocations take them
    back. Whatever is stored must hold its tokens' rows (checked after every call)."""
    length, chunk = 24, 3
    blocks = min_live_blocks(length, window, tpb, chunk) + spare
    cfg = BlockManagerConfig(
        [LayerSpec(window, 1, 1)],
        max_seq_len=length,
        kv_budget_bytes=blocks * 4 * tpb,
        host_budget_bytes=host * 4 * tpb,
        tokens_per_block=tpb,
        max_tokens_per_call=chunk,
        default_priority=default_priority,
    )
    rt = _Runtime(KVBlockManager(cfg, env={}))
    base = list(range(1, prefix * tpb + 1))
    rt.add_chunked("s0", base, chunk)
    rt.remove("s0")
    rt.add_chunked("X", base + [90], chunk)
    for step, n in enumerate(grow):
        if len(rt.tokens["X"]) + n > length:
            break
        rt.extend("X", [100 + step] * n)
        if step == 1:  # X's prefix blocks are detached by now: Y claims them, then ends
            with contextlib.suppress(OutOfBlocksError):  # X may hold too much right now
                rt.add_chunked("Y", base + [91], chunk)
            if "Y" in rt.tokens:
                rt.remove("Y")
    rt.remove("X")
    assert rt.mgr.stats().live_sequences == 0


def test_onboard_leaves_the_onboarding_sequence_storable() -> None:
    """The empty block an onboard pushes to the host had the sequence as owner; reusing it for
    the next offload invalidated the live sequence although none of its bytes were touched."""
    rt = _Runtime(mgr := _swa2(host=4))
    wm = mgr.windows[2]
    rt.add("s0", [1, 2, 3, 4])
    rt.remove("s0")
    rt.add("w", [7, 7, 7, 7])
    rt.extend("w", [7, 7])
    rt.remove("w")  # pushes s0's cached blocks to the host
    assert wm.counters.offloads >= 4
    assert rt.add("X", [1, 2, 3, 4, 5]) == 4 and wm.counters.onboards == 1
    x = wm.seqs[mgr._seqs["X"].serial]
    assert not [b for b in wm.blocks if b.pool is PoolKind.HOST and b.last_owner == x.serial]
    for n in range(12):  # unrelated traffic that offloads through the host pool
        rt.add(("q", n), [50 + n, 60 + n])
        rt.remove(("q", n))
    assert x.storable and wm.counters.invalidated_sequences == 0
    rt.remove("X")
    assert mgr.lookup([1, 2, 3, 4, 5, 0]).hit_tokens == 5  # X's chain was stored


def test_budget_accepted_at_construction_fits_one_max_seq_len_prompt() -> None:
    """The reviewer's case: 17 SWA blocks were accepted, then a 1000-token prompt could never
    be added and the error blamed live sequences that did not exist."""
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
    mgr = KVBlockManager(cfg, env={})
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


def test_out_of_blocks_says_the_largest_call_that_fits() -> None:
    mgr = build([None], [10], max_seq_len=16, tpb=2)
    mgr.add_sequence("a", list(range(8)))  # 4 blocks
    mgr.add_sequence("b", list(range(50, 58)))  # 4 blocks, 2 free
    before = mgr.stats()
    with pytest.raises(OutOfBlocksError, match="a call adding at most 4 tokens fits now"):
        mgr.add_tokens("a", [1, 2, 3, 4, 5, 6])  # 3 blocks
    assert mgr.stats() == before
    mgr.add_tokens("a", [1, 2, 3, 4])  # ... and 4 tokens do fit
    with pytest.raises(OutOfBlocksError, match="no call fits now, not even one token"):
        mgr.add_sequence("c", [9, 9, 9])
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


def test_offload_and_onboard_events_carry_window_size() -> None:
    mgr = build([None], [4], max_seq_len=8, tpb=2, host=[4])
    mgr.add_sequence("a", [1, 2, 3, 4, 5])
    mgr.remove_sequence("a")
    tree = mgr.windows[8].tree
    assert tree is not None
    a_hashes = {n.block_hash for n in tree.walk([1, 2, 3, 4], 2)}
    mgr.drain_events()
    mgr.add_sequence("b", [9, 9, 9, 9, 9, 9, 9])  # 4 blocks: a's 2 cached blocks go to host
    moved = [e for e in mgr.drain_events() if e.kind == "offloaded"]
    assert [(e.window_size, e.num_tokens) for e in moved] == [(8, 2), (8, 2)]
    assert {e.block_hash for e in moved} == a_hashes
    assert (
        moved[1].parent_hash == moved[0].block_hash or moved[0].parent_hash == moved[1].block_hash
    )
    mgr.remove_sequence("b")
    assert mgr.add_sequence("c", [1, 2, 3, 4, 5]) == 4
    events = mgr.drain_events()
    back = [e for e in events if e.kind == "onboarded"]
    assert {(e.window_size, e.block_hash) for e in back} == {(8, h) for h in a_hashes}
    st_ = mgr.stats()
    assert st_.offloads == len(moved) + sum(e.kind == "offloaded" for e in events)
    assert st_.onboards == len(back) == 2
    mgr.check_invariants()


def test_detached_swa_offload_event_has_no_hash() -> None:
    mgr = build([4, None], [4, 16], max_seq_len=16, tpb=2, host=[2, 8], max_tokens_per_call=2)
    mgr.add_sequence("a", [1])
    for t in range(2, 9):
        mgr.add_tokens("a", [t])
    mgr.drain_events()
    mgr.add_sequence("b", [50, 51])  # a's detached (uncached) block moves to the host
    (event,) = [e for e in mgr.drain_events() if e.kind == "offloaded"]
    assert (event.window_size, event.block_hash, event.parent_hash) == (4, 0, 0)


def test_numpy_integer_priorities_are_accepted() -> None:
    mgr = build([4, None], [8, 16], max_seq_len=16, tpb=2)
    mgr.add_sequence("a", [1, 2, 3, 4, 5], priority=np.int64(50))
    mgr.add_sequence("b", [1, 2, 3], priority=[PriorityRange(0, None, np.int32(90))])  # type: ignore[arg-type]
    wm = mgr.windows[16]
    assert [b.priority for b in wm.seqs[0].live()] == [50, 50, 50]
    assert all(type(b.priority) is int for b in wm.seqs[1].live())
    assert (
        KVBlockManager(
            BlockManagerConfig([LayerSpec(None, 1, 1)], 8, 1 << 10, default_priority=np.uint8(7)),  # type: ignore[arg-type]
            env={},
        ).add_sequence("x", [1])
        == 0
    )
    mgr.check_invariants()


@pytest.mark.parametrize(
    ("priority", "match"),
    [
        (50.0, "priority=50.0 is not an integer"),
        ("50", "priority='50' is not an integer"),
        (True, "priority=True is not an integer"),
        ([50], "50 is not a PriorityRange"),
        ([PriorityRange(0, None, 1.5)], r"PriorityRange.priority=1.5 is not an integer"),  # type: ignore[arg-type]
        (np.int64(101), r"priority=101 is outside \[0, 100\]"),
    ],
)
def test_bad_priority_types_are_config_errors(priority: object, match: str) -> None:
    mgr = build([4, None], [8, 16], max_seq_len=16, tpb=2)
    before = mgr.stats()
    with pytest.raises(ConfigError, match=match):
        mgr.add_sequence("p", [1, 2, 3], priority=priority)  # type: ignore[arg-type]
    assert mgr.stats() == before and not mgr.sequence_ids
    mgr.check_invariants()


def test_fingerprint_helper_depends_on_the_whole_prefix() -> None:
    assert fingerprints([1, 2])[1] != fingerprints([3, 2])[1]
