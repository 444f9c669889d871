"""A reset block (handed out, or emptied in the host pool for an offload) is stale for every
table slot that recorded it, and an invalidated owner's kept blocks are worthless at once."""

from __future__ import annotations

from blocks_helpers import build

from npuw_kv.kv.blocks import BlockManagerConfig, KVBlockManager, PoolKind, uniform_layers
from npuw_kv.kv.blocks.block import EMPTY_LEVEL


def test_host_block_emptied_for_an_offload_is_not_recached_through_a_stale_slot() -> None:
    """b and then c claim block 1 from a's chain; c's allocation empties it in the host pool
    (its victim is not worth offloading). b's detached slot must see it as reset: storing it
    at b's end would cache a worthless block (and, later, bytes it no longer holds)."""
    cfg = BlockManagerConfig(
        layers=uniform_layers([2], 1, 4),
        max_seq_len=10,
        kv_budget_bytes=80,
        host_budget_bytes=16,
        tokens_per_block=1,
        max_tokens_per_call=3,
    )
    m = KVBlockManager(cfg, env={})
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
