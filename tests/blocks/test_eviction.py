"""Eviction: priority levels with LRU, non-leaf release, offload to host and onboard."""

from __future__ import annotations

import numpy as np
import pytest
from blocks_helpers import Runtime, build, fill_rows, rows

from npuw_kv.kv.blocks import (
    BlockManagerConfig,
    KVBlockManager,
    LayerSpec,
    PoolKind,
    PriorityRange,
)
from npuw_kv.kv.blocks.block import EMPTY_LEVEL, KVBlock
from npuw_kv.kv.blocks.eviction import EvictionQueue

pytestmark = pytest.mark.unit  # builds no model (the quick tier)


def test_queue_orders_by_priority_then_lru() -> None:
    q = EvictionQueue()
    blocks = [KVBlock(i, PoolKind.PRIMARY, i) for i in range(5)]
    q.push(blocks[0], 50)
    q.push(blocks[1], 10)
    q.push(blocks[2], 50)
    q.push(blocks[3], 10)
    q.push(blocks[4], EMPTY_LEVEL)
    assert [q.pop_victim().block_id for _ in range(5)] == [4, 1, 3, 0, 2]
    assert len(q) == 0


def test_lru_within_a_level_and_priority_per_request() -> None:
    mgr = build([None], [4], max_seq_len=6, tpb=2)
    for sid, toks, prio in [("a", [1, 2, 9], 80), ("b", [3, 4, 9], None), ("c", [5, 6, 9], None)]:
        mgr.add_sequence(sid, toks, priority=prio)
        mgr.remove_sequence(sid)
    tree = mgr.windows[6].tree
    assert tree is not None and tree.cached_blocks == 3
    # one empty block, then b (default level, released before c), then c; a (80) survives
    mgr.add_sequence("x", [7, 7, 7])  # 2 blocks
    assert mgr.lookup([1, 2, 0]).hit_tokens == 2  # a kept: higher level
    assert mgr.lookup([3, 4, 0]).hit_tokens == 0  # b evicted: least recently released
    assert mgr.lookup([5, 6, 0]).hit_tokens == 2  # c kept
    mgr.add_sequence("y", [8])  # next victim: c, still before a
    assert mgr.lookup([5, 6, 0]).hit_tokens == 0 and mgr.lookup([1, 2, 0]).hit_tokens == 2
    mgr.check_invariants()


def test_priority_ranges_keep_a_system_prompt() -> None:
    mgr = build([None], [4], max_seq_len=8, tpb=2)
    system = [1, 1, 2, 2]
    mgr.add_sequence("a", system + [3, 3, 9], priority=[PriorityRange(0, 4, 90)])
    mgr.remove_sequence("a")
    mgr.add_sequence("x", [8, 8, 9])  # needs 2 blocks: takes the two above the system prompt
    assert mgr.lookup(system + [0]).hit_tokens == 4
    mgr.check_invariants()


def test_non_leaf_eviction_cuts_children_and_keeps_tree_consistent() -> None:
    mgr = build([None], [4], max_seq_len=8, tpb=2)
    # root block low priority, its children high: the non-leaf root block is the victim
    mgr.add_sequence("a", [1, 2, 3, 4, 5, 6, 0], priority=[PriorityRange(0, 2, 5)])
    mgr.remove_sequence("a")
    wm = mgr.windows[8]
    assert wm.tree is not None and wm.tree.cached_blocks == 3
    mgr.drain_events()
    mgr.add_sequence("x", [9])  # one block: the free one (empty level) first
    assert wm.tree.cached_blocks == 3
    mgr.add_sequence("y", [9])  # next: the non-leaf block [1, 2]
    removed = [e for e in mgr.drain_events() if e.kind == "removed"]
    assert len(removed) == 3  # the victim and both descendants left the tree
    assert wm.tree.cached_blocks == 0 and not wm.tree.root.children
    cut = [b for b in wm.blocks if b.ref_count == 0]
    assert all(b.node is None and b.queue_level == EMPTY_LEVEL for b in cut)
    assert mgr.lookup([1, 2, 3, 4, 5, 6, 0]).hit_tokens == 0
    mgr.check_invariants()
    # the tree keeps working after the cut
    mgr.add_sequence("z", [1, 2, 3])
    mgr.remove_sequence("z")
    assert mgr.lookup([1, 2, 3]).hit_tokens == 2
    mgr.check_invariants()


def test_a_full_attention_chain_is_evicted_from_its_end() -> None:
    """Evicting a chain's first block would cut every block after it from the tree, so at one
    priority an ended sequence's blocks are queued tail first and it shrinks from its end."""
    mgr = build([None], [5], max_seq_len=10, tpb=2)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    mgr.add_sequence("a", a)  # 4 full blocks cached, the partial 5th freed at the end
    mgr.remove_sequence("a")
    mgr.add_sequence("b", [50, 51, 52, 53, 54, 55])  # 3 blocks: the free one and 2 of a's
    assert mgr.lookup(a).hit_tokens == 4  # a's last two went; its first two still serve
    mgr.check_invariants()


def test_offload_to_host_then_onboard_on_hit_keeps_bytes() -> None:
    mgr = build([None], [4], max_seq_len=8, tpb=2, host=[4])
    wm = mgr.windows[8]
    assert wm.tree is not None
    a = [1, 2, 3, 4, 5]
    mgr.add_sequence("a", a)
    fill_rows(mgr, "a", 0, 5, seed=7)
    original = rows(mgr, "a", 8, 0, 4)
    mgr.remove_sequence("a")
    mgr.add_sequence("x", [9, 9, 9, 9, 9, 9, 9])  # 4 blocks: both cached blocks are victims
    assert wm.counters.offloads == 2
    cached = [n.block for n in wm.tree.walk(a, 2)]
    assert all(b is not None and b.pool is PoolKind.HOST for b in cached)
    st = mgr.stats().windows[8]
    assert st.host_free == 4 and st.primary_free == 0  # host blocks are reclaimable cache
    host_bytes = np.concatenate([wm.host.store[b.slot] for b in cached if b is not None])
    assert np.array_equal(host_bytes, original)
    mgr.remove_sequence("x")
    assert mgr.add_sequence("b", a + [6]) == 4
    assert wm.counters.onboards == 2
    assert all(b is not None and b.pool is PoolKind.PRIMARY for b in cached)
    assert np.array_equal(rows(mgr, "b", 8, 0, 4), original)  # primary -> host -> primary
    assert mgr.stats().onboards == 2 and mgr.stats().offloads >= 2
    mgr.check_invariants()


def test_low_priority_victims_are_dropped_not_offloaded() -> None:
    mgr = build([None], [4], max_seq_len=8, tpb=2, host=[4], offload_min_priority=50)
    mgr.add_sequence("a", [1, 2, 3], priority=20)
    mgr.remove_sequence("a")
    mgr.add_sequence("x", [9] * 7)
    assert mgr.windows[8].counters.offloads == 0
    assert mgr.lookup([1, 2, 3]).hit_tokens == 0
    mgr.check_invariants()


def test_no_offload_when_host_pool_has_no_room() -> None:
    mgr = build([None], [4], max_seq_len=8, tpb=2, host=[1])
    wm = mgr.windows[8]
    mgr.add_sequence("keep", [7, 7, 0], priority=90)
    mgr.remove_sequence("keep")
    mgr.add_sequence("x", [9] * 7)  # pushes the priority-90 block to the single host block
    mgr.remove_sequence("x")
    assert wm.counters.offloads == 1
    mgr.add_sequence("a", [1, 2, 3], priority=40)
    mgr.remove_sequence("a")
    mgr.add_sequence("y", [8] * 7)  # a's block is a victim, but the host holds a 90: dropped
    assert wm.counters.offloads == 1
    assert mgr.lookup([1, 2, 3]).hit_tokens == 0 and mgr.lookup([7, 7, 0]).hit_tokens == 2
    mgr.check_invariants()


def test_layer_views_are_typed_and_survive_offload() -> None:
    cfg = BlockManagerConfig(
        [LayerSpec(None, 2, 4), LayerSpec(None, 3, 8)],
        max_seq_len=8,
        kv_budget_bytes=4 * 2 * 2 * (2 * 4 + 3 * 8) * 2,
        host_budget_bytes=4 * 2 * 2 * (2 * 4 + 3 * 8) * 2,
        tokens_per_block=2,
    )
    mgr = KVBlockManager(cfg)
    mgr.add_sequence("a", [1, 2, 3])
    slot = mgr.block_table("a", 8)[0]
    v0, v1 = mgr.layer_view(8, slot, 0), mgr.layer_view(8, slot, 1)
    assert v0.shape == (2, 2, 2, 4) and v1.shape == (2, 2, 3, 8) and v1.dtype == np.float16
    v0[:] = np.arange(v0.size).reshape(v0.shape)
    v1[:] = -np.arange(v1.size).reshape(v1.shape)
    k0, k1 = v0.copy(), v1.copy()
    mgr.remove_sequence("a")
    mgr.add_sequence("x", [9] * 7)  # offloads the cached block
    mgr.remove_sequence("x")
    mgr.add_sequence("b", [1, 2, 3])  # onboards it
    slot = mgr.block_table("b", 8)[0]
    assert np.array_equal(mgr.layer_view(8, slot, 0), k0)
    assert np.array_equal(mgr.layer_view(8, slot, 1), k1)
    assert mgr.windows[8].counters.onboards == 1


def test_onboard_leaves_the_onboarding_sequence_storable() -> None:
    """The empty block an onboard pushes to the host holds nobody's bytes: using it for later
    offloads must not invalidate the live sequence that onboarded."""
    rt = Runtime(mgr := build([2], [6], max_seq_len=16, tpb=1, host=[4], max_tokens_per_call=5))
    wm = mgr.windows[2]
    rt.add("s0", [1, 2, 3, 4])
    rt.remove("s0")
    rt.add("w", [7, 7, 7, 7])
    rt.add_tokens("w", [7, 7])
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
        ).add_sequence("x", [1])
        == 0
    )
    mgr.check_invariants()
