"""Stats and events: hits, misses, hit rate, free blocks, bytes, offloads, stored/removed."""

from __future__ import annotations

import pytest
from blocks_helpers import build

pytestmark = pytest.mark.unit  # builds no model (the quick tier)


def test_hits_misses_rate_free_blocks_and_bytes() -> None:
    mgr = build([4, None], [6, 12], max_seq_len=16, tpb=2, host=[2, 4], max_tokens_per_call=8)
    st = mgr.stats()
    assert st.windows[4].primary_free == 6 and st.windows[16].primary_free == 12
    assert st.windows[4].host_free == 2 and st.windows[16].host_free == 4
    assert st.bytes_allocated == (6 + 12 + 2 + 4) * 2 * 4  # blocks * tpb * bytes/token
    assert st.hit_rate == 0.0
    mgr.add_sequence("a", [1, 2, 3, 4, 5])
    mgr.remove_sequence("a")
    assert mgr.add_sequence("b", [1, 2, 3, 4, 5, 6]) == 4
    st = mgr.stats()
    assert st.prompt_tokens == 11 and st.hit_tokens == 4 and st.miss_tokens == 7
    assert st.hit_rate == 4 / 11
    w16 = st.windows[16]
    assert w16.primary_used == 3 and w16.primary_free == 9 and w16.bytes_in_use == 3 * 2 * 4
    assert w16.counters.reused_blocks == 2 and w16.counters.allocated_blocks == 3 + 1
    assert st.live_sequences == 1 and st.sequences_added == 2 and st.sequences_removed == 1
    mgr.check_invariants()


def test_stored_and_removed_events_carry_window_size() -> None:
    mgr = build([4, None], [4, 8], max_seq_len=8, tpb=2)
    mgr.add_sequence("a", [1, 2, 3, 4, 5])
    events = mgr.drain_events()
    assert [(e.kind, e.window_size) for e in events] == [("stored", 8), ("stored", 8)]
    assert events[1].parent_hash == events[0].block_hash and events[0].num_tokens == 2
    mgr.remove_sequence("a")
    events = mgr.drain_events()
    assert [(e.kind, e.window_size) for e in events] == [("stored", 4), ("stored", 4)]
    assert mgr.drain_events() == []
    # 7 tokens in one call hold 4 SWA blocks: the SWA pool (4) must evict a's two cached
    # blocks; the full pool (8) still has empty blocks, so its cache stays
    mgr.add_sequence("x", [9, 9, 9, 9, 9, 9, 9])
    removed = [(e.kind, e.window_size) for e in mgr.drain_events() if e.kind == "removed"]
    assert removed == [("removed", 4)] * 2
    st = mgr.stats()
    for ws in st.windows.values():
        c = ws.counters
        assert c.stored_blocks - c.removed_blocks == ws.cached_blocks


def test_event_buffer_is_bounded_but_counters_are_not() -> None:
    mgr = build([None], [8], max_seq_len=16, tpb=2)
    mgr._events = type(mgr._events)(maxlen=3)  # small buffer for the test
    mgr.add_sequence("a", list(range(15)))
    st = mgr.stats()
    assert st.events_dropped == 4 and len(mgr.drain_events()) == 3
    assert st.windows[16].counters.stored_blocks == 7


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
