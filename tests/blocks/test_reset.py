"""A reset block (handed out, or emptied in the host pool for an offload) is stale for every
table slot that recorded it, and an invalidated owner's kept blocks are worthless at once."""

from __future__ import annotations

import contextlib

import pytest
from blocks_helpers import Runtime, build
from hypothesis import given, settings
from hypothesis import strategies as st

from npuw_kv.kv.blocks import (
    BlockManagerConfig,
    KVBlockManager,
    OutOfBlocksError,
    PoolKind,
    uniform_layers,
)
from npuw_kv.kv.blocks.block import EMPTY_LEVEL
from npuw_kv.kv.blocks.sequence import min_live_blocks

pytestmark = pytest.mark.unit  # builds no model (the quick tier)


def test_host_block_emptied_for_an_offload_is_not_recached_through_a_stale_slot() -> None:
    """b and then c claim block 1 from a's chain; c's allocation empties it in the host pool
    (its victim is not worth offloading). b's detached slot must see it as reset: storing it
    at b's end would cache a worthless block (and, later, bytes it no longer holds)."""
    cfg = BlockManagerConfig(
        layers=uniform_layers([2], 1, 4),
        max_seq_len=10,
        primary_blocks={2: 5},
        host_blocks={2: 1},
        tokens_per_block=1,
        max_tokens_per_call=3,
    )
    m = KVBlockManager(cfg)
    m.add_sequence("a", [1, 2])
    m.remove_sequence("a")
    m.add_sequence("b", [1, 2, 3])
    m.add_tokens("b", [4])
    m.add_sequence("c", [1, 2, 99, 99])
    m.add_tokens("c", [99, 99])
    m.check_invariants()  # b's detached slot 1 no longer claims the emptied block
    wm = m.windows[2]
    emptied = next(b for b in wm.blocks if b.pool is PoolKind.HOST)
    assert emptied.queue_level == EMPTY_LEVEL and emptied.node is None
    m.remove_sequence("b")
    m.check_invariants()
    assert emptied.node is None, "b stored the emptied host block through its stale slot"
    m.remove_sequence("c")
    m.check_invariants()


def test_invalidated_owner_kept_blocks_go_before_cached_blocks() -> None:
    """Once a's chain cannot be stored, its kept detached block is worthless: the next
    allocation takes it, not the cached block of an earlier conversation released before it."""
    m = build([2], [6], max_seq_len=8, tpb=1, max_tokens_per_call=1)
    m.add_sequence("a", [1])
    m.add_tokens("a", [2])
    m.add_tokens("a", [3])  # detaches a's block 0, kept for storing a at its end
    m.add_sequence("old", [5])
    m.add_tokens("old", [6])
    m.remove_sequence("old")  # cached: [5] and [5, 6]
    m.add_tokens("a", [4])  # detaches a's block 1: the LRU queue is a0, old0, old1, a1
    assert m.lookup([5, 6]).hit_tokens == 1
    m.add_sequence("b", [9])  # takes a0: a can no longer be stored, so a1 is worthless now
    kept = m.windows[2].seqs[m._seqs["a"].serial].table[1]
    assert kept is not None and kept.queue_level == EMPTY_LEVEL
    m.add_tokens("b", [9])  # takes a1, not old0
    assert m.lookup([5, 6]).hit_tokens == 1
    m.check_invariants()


def test_owner_reallocating_its_own_stale_detached_block_does_not_store_it() -> None:
    """X detaches cached block b, Y claims b and ends, X's own allocation takes b back and
    writes other tokens into it: X's old slot must not be stored (it held token 9's row)."""
    # one SWA-2 layer, one token per block, 6 primary blocks
    rt = Runtime(mgr := build([2], [6], max_seq_len=16, tpb=1, max_tokens_per_call=5))
    wm = mgr.windows[2]
    rt.add("s0", [1, 2, 3, 4])
    rt.remove("s0")
    assert rt.add("X", [1, 2, 3, 4, 5]) == 4
    b4 = wm.seqs[1].table[3]
    rt.add_tokens("X", [6])  # b4 detached (kept: it is cached)
    assert rt.add("Y", [1, 2, 3, 4, 9]) == 4  # Y claims b4 (X's detached slot)
    rt.remove("Y")
    t = 7
    while b4 not in wm.seqs[1].live():  # X's own allocations cycle back to b4
        rt.add_tokens("X", [t])
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
    """The case above, generalised: X hits a cached prefix and outgrows it, Y claims X's
    detached blocks and ends, X keeps writing until its own allocations take them back.
    Whatever is stored must hold its tokens' rows (checked after every call)."""
    length, chunk = 24, 3
    blocks = min_live_blocks(length, window, tpb, chunk) + spare
    mgr = build(
        [window],
        [blocks],
        max_seq_len=length,
        tpb=tpb,
        host=[host],
        max_tokens_per_call=chunk,
        default_priority=default_priority,
    )
    rt = Runtime(mgr)
    base = list(range(1, prefix * tpb + 1))
    rt.add_chunked("s0", base, chunk)
    rt.remove("s0")
    rt.add_chunked("X", base + [90], chunk)
    for step, n in enumerate(grow):
        if len(rt.tokens["X"]) + n > length:
            break
        rt.add_tokens("X", [100 + step] * n)
        if step == 1:  # X's prefix blocks are detached by now: Y claims them, then ends
            with contextlib.suppress(OutOfBlocksError):  # X may hold too much right now
                rt.add_chunked("Y", base + [91], chunk)
            if "Y" in rt.tokens:
                rt.remove("Y")
    rt.remove("X")
    assert rt.mgr.stats().live_sequences == 0
