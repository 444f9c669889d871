"""Prefix reuse: radix tree, full vs SWA storing, last-owner invalidation, SWA hit rule."""

from __future__ import annotations

import numpy as np
import pytest
from blocks_helpers import Runtime, build, fill_rows, rows
from hypothesis import given, settings
from hypothesis import strategies as st

from npuw_kv.kv.blocks import ConfigError, KVBlockManager
from npuw_kv.kv.blocks.reuse_tree import chain_hash

pytestmark = pytest.mark.unit  # builds no model (the quick tier)


def test_full_attention_stores_blocks_as_they_fill() -> None:
    mgr = build([4, None], [8, 16], max_seq_len=16, tpb=2)
    mgr.add_sequence("a", [1, 2, 3])  # one full block
    full = mgr.windows[16]
    assert full.tree is not None and full.tree.cached_blocks == 1
    mgr.add_tokens("a", [4, 5])  # second block fills
    assert full.tree.cached_blocks == 2
    # the SWA window stores nothing while the sequence lives
    assert mgr.windows[4].tree is not None and mgr.windows[4].tree.cached_blocks == 0
    hit = mgr.lookup([1, 2, 3, 4, 5, 6])
    assert hit.per_window[16] == 4 and hit.per_window[4] == 0 and hit.hit_tokens == 0


def test_a_sequence_may_skip_reading_the_cache_and_still_stores_its_blocks() -> None:
    mgr = build([None], [8], max_seq_len=16, tpb=2)
    mgr.add_sequence("a", [1, 2, 3, 4, 5])
    mgr.remove_sequence("a")
    assert mgr.add_sequence("cold", [1, 2, 3, 4, 5, 6], reuse=False) == 0
    full = mgr.windows[16]
    # a's two blocks stay cached (cold's copies of them stay private) and cold's [5, 6] joins
    assert full.tree is not None and full.tree.cached_blocks == 3
    assert set(mgr.block_table("cold", 16)).isdisjoint(
        n.block.slot for n in full.tree.walk([1, 2, 3, 4], 2) if n.block is not None
    )
    mgr.add_tokens("cold", [7])
    mgr.remove_sequence("cold")
    assert mgr.add_sequence("b", [1, 2, 3, 4, 5, 6, 7, 8]) == 6
    assert mgr.stats().hit_tokens == 6
    mgr.check_invariants()


def test_tokens_added_with_store_false_seal_the_sequence() -> None:
    """A runtime whose token-by-token blocks differ from a fresh prefill's (u8 KV) keeps them
    out of the tree.  Both kinds of group store the blocks complete before the seal: full
    attention as they fill, SWA when the sequence ends."""
    mgr = build([4, None], [8, 16], max_seq_len=16, tpb=2, max_tokens_per_call=8)
    mgr.add_sequence("a", [1, 2, 3, 4, 5])  # full blocks [1, 2] [3, 4] stored as they fill
    mgr.add_token("a", 6, store=False)  # completes [5, 6]: not stored
    mgr.add_tokens("a", [7, 8])  # sealed: later blocks are not stored either
    full = mgr.windows[16]
    assert full.tree is not None and full.tree.cached_blocks == 2
    mgr.remove_sequence("a")
    assert mgr.windows[4].tree is not None and mgr.windows[4].tree.cached_blocks == 2  # SWA
    hit = mgr.lookup([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert hit.per_window == {4: 4, 16: 4} and hit.hit_tokens == 4  # nothing after the seal
    mgr.check_invariants()


def test_a_sequence_that_takes_back_its_own_detached_block_still_stores_its_tail() -> None:
    """Getting one's own detached block back costs only that slot: the blocks after it are
    still stored, so a longer prompt can start from the sequence's end."""
    mgr = _swa_tight()
    tokens = list(range(1, 17))  # 8 blocks of 2 through an SWA-4 pool of 4
    mgr.add_sequence("a", tokens[:4])
    for start in range(4, 16, 4):
        mgr.add_tokens("a", tokens[start : start + 4])
    wm = mgr.windows[4]
    assert wm.seqs[0].storable and wm.counters.invalidated_sequences == 0
    mgr.remove_sequence("a")
    hit = mgr.lookup([*tokens, 99])
    assert hit.per_window[4] == 16 and hit.hit_tokens == 16  # the trailing blocks were kept
    mgr.check_invariants()


def test_swa_stores_at_remove_and_hits_are_whole_blocks() -> None:
    mgr = build([4, None], [8, 16], max_seq_len=16, tpb=2)
    mgr.add_sequence("a", [1, 2, 3, 4, 5, 6, 7])
    fill_rows(mgr, "a", 0, 7, seed=1)
    expected = {w: rows(mgr, "a", w, 0, 6) for w in mgr.groups}
    mgr.remove_sequence("a")
    assert mgr.windows[4].tree is not None and mgr.windows[4].tree.cached_blocks == 3
    # last prompt token is always computed; hit rounds down to blocks
    assert mgr.lookup([1, 2, 3, 4, 5, 6, 7]).hit_tokens == 6
    assert mgr.lookup([1, 2, 3, 4, 5, 6]).hit_tokens == 4
    assert mgr.lookup([1, 2, 3, 4, 9, 9, 9]).hit_tokens == 4
    assert mgr.lookup([2, 2, 3, 4, 5, 6, 7]).hit_tokens == 0
    assert mgr.add_sequence("b", [1, 2, 3, 4, 5, 6, 8, 9]) == 6
    # SWA-4 reads only ceil(3/2) = 2 blocks before the hit: block 0 starts detached
    assert mgr.block_table("b", 4)[0] == -1
    assert np.array_equal(rows(mgr, "b", 4, 2, 6), expected[4][2:6])
    assert np.array_equal(rows(mgr, "b", 16, 0, 6), expected[16])
    mgr.check_invariants()


def test_tree_keys_chain_hashes_with_parent() -> None:
    mgr = build([None], [16], max_seq_len=16, tpb=2)
    mgr.add_sequence("a", [1, 2, 3, 4, 5])
    tree = mgr.windows[16].tree
    assert tree is not None
    (n1,) = tree.root.children.values()
    (n2,) = n1.children.values()
    assert n1.key == (1, 2) and n2.key == (3, 4)
    assert n2.block_hash == chain_hash(n1.block_hash, (3, 4)) != chain_hash(0, (3, 4))


def _swa_tight() -> KVBlockManager:
    # SWA-4 with tpb 2 holds at most 3 live blocks a token at a time, 4 with 4-token calls
    return build([4, None], [4, 20], max_seq_len=16, tpb=2, max_tokens_per_call=4)


def _grow_token_by_token(mgr: KVBlockManager, sid: str, tokens: list[int]) -> None:
    mgr.add_sequence(sid, tokens[:1])
    for t in tokens[1:]:
        mgr.add_tokens(sid, [t])


def test_sequence_whose_block_was_reclaimed_is_not_stored() -> None:
    control = _swa_tight()
    _grow_token_by_token(control, "a", [1, 2, 3, 4, 5, 6, 7, 8])
    control.remove_sequence("a")
    assert control.stats().windows[4].cached_blocks == 4

    mgr = _swa_tight()
    _grow_token_by_token(mgr, "a", [1, 2, 3, 4, 5, 6, 7, 8])  # 2 detached + 2 live = pool full
    wm = mgr.windows[4]
    mgr.add_sequence("b", [50, 51])  # needs one block: takes a's oldest detached block
    assert not wm.seqs[0].storable and wm.counters.invalidated_sequences == 1
    mgr.drain_events()
    mgr.remove_sequence("a")
    assert mgr.stats().windows[4].cached_blocks == 0
    assert not [e for e in mgr.drain_events() if e.window_size == 4]
    # the full-attention window still stored a's blocks as they filled
    hit = mgr.lookup([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert hit.per_window == {4: 0, 16: 8} and hit.hit_tokens == 0
    mgr.check_invariants()


def test_swa_hit_needs_only_trailing_blocks_and_sequence_hit_is_min() -> None:
    mgr = _swa_tight()
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    _grow_token_by_token(mgr, "a", a)
    mgr.remove_sequence("a")
    # c takes the two least recently released SWA blocks: a's blocks 0 and 1 (detached first)
    mgr.add_sequence("c", [70, 71, 72, 73])
    mgr.remove_sequence("c")
    tree = mgr.windows[4].tree
    assert tree is not None
    path = tree.walk(a, 4)
    assert [n.block is not None for n in path] == [False, False, True, True]  # hollow front
    # hit at 8 tokens needs blocks 2 and 3 only: usable; at 4 tokens it needs 0 and 1: not
    hit8 = mgr.lookup(a + [9])
    assert hit8.per_window == {4: 8, 16: 8} and hit8.hit_tokens == 8
    hit4 = mgr.lookup(a[:4] + [9])
    assert hit4.per_window == {4: 0, 16: 4} and hit4.hit_tokens == 0  # min over windows
    assert mgr.add_sequence("d", a + [9]) == 8
    assert mgr.block_table("d", 4)[:2] == [-1, -1]
    mgr.check_invariants()


def test_live_swa_blocks_are_never_shared_a_second_hit_copies() -> None:
    mgr = build([4, None], [12, 24], max_seq_len=16, tpb=2)
    mgr.add_sequence("a", [1, 2, 3, 4, 5])
    fill_rows(mgr, "a", 0, 5, seed=3)
    want = rows(mgr, "a", 4, 2, 4)
    mgr.remove_sequence("a")
    assert mgr.add_sequence("b", [1, 2, 3, 4, 5, 6]) == 4
    assert mgr.add_sequence("c", [1, 2, 3, 4, 5, 7]) == 4
    wm = mgr.windows[4]
    assert wm.counters.copied_blocks == 2  # c copied the blocks b holds
    sb, sc = mgr.block_table("b", 4), mgr.block_table("c", 4)
    assert not set(sb) - {-1} & set(sc) - {-1}
    assert np.array_equal(rows(mgr, "c", 4, 2, 4), want)
    # the full-attention window shares the same blocks instead
    assert mgr.block_table("b", 16)[:2] == mgr.block_table("c", 16)[:2]
    mgr.check_invariants()


def test_reuse_off_never_caches() -> None:
    mgr = build([4, None], [8, 16], max_seq_len=16, tpb=2, enable_reuse=False)
    mgr.add_sequence("a", [1, 2, 3, 4, 5])
    mgr.remove_sequence("a")
    assert mgr.add_sequence("b", [1, 2, 3, 4, 5]) == 0
    assert mgr.stats().windows[16].cached_blocks == 0
    mgr.check_invariants()


def test_max_hit_tokens_caps_the_hit_or_allows_the_whole_prompt() -> None:
    rt = Runtime(mgr := build([4, None], [12, 24], max_seq_len=16, tpb=2))
    rt.add("a", [1, 2, 3, 4, 5, 6, 7])  # writes every row, like a runtime
    rt.remove("a")
    prompt = [1, 2, 3, 4, 5, 6]
    assert mgr.lookup(prompt).hit_tokens == 4  # default: one token left to compute
    assert mgr.lookup(prompt, max_hit_tokens=6).hit_tokens == 6  # a store copying bytes
    assert mgr.lookup(prompt, max_hit_tokens=99).hit_tokens == 6  # never past the prompt
    assert mgr.lookup(prompt, max_hit_tokens=3).hit_tokens == 2  # whole blocks below the cap
    assert mgr.lookup(prompt, max_hit_tokens=0).hit_tokens == 0
    assert rt.add("b", prompt, max_hit_tokens=6) == 6  # nothing to compute: rows checked
    assert mgr.block_table("b", 4)[0] == -1  # SWA-4 reads only the 2 blocks before token 6
    mgr.check_invariants()
    rt.add_tokens("b", [7, 8])
    rt.remove("b")
    assert mgr.stats().hit_tokens == 6 and mgr.stats().miss_tokens == 7


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_bad_max_hit_tokens_is_a_config_error(bad: object) -> None:
    mgr = build([None], [8], max_seq_len=16, tpb=2)
    before = mgr.stats()
    with pytest.raises(ConfigError, match="max_hit_tokens=.* must be an integer >= 0"):
        mgr.lookup([1, 2, 3], max_hit_tokens=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="max_hit_tokens"):
        mgr.add_sequence("a", [1, 2, 3], max_hit_tokens=bad)  # type: ignore[arg-type]
    assert mgr.stats() == before and not mgr.sequence_ids


@settings(max_examples=150, deadline=None)
@given(
    window=st.integers(1, 7),
    tpb=st.integers(1, 3),
    stored=st.lists(st.integers(0, 2), min_size=1, max_size=14),
    extra=st.lists(st.integers(0, 2), max_size=4),
    cap=st.integers(0, 16),
)
def test_add_sequence_takes_what_lookup_says_under_any_cap(
    window: int, tpb: int, stored: list[int], extra: list[int], cap: int
) -> None:
    """Whatever the cap, ``add_sequence`` reuses exactly what ``lookup`` promised, every row
    the next token reads holds its token's bytes, and the sequence goes on from there."""
    mgr = build([window, None], [16, 16], max_seq_len=16, tpb=tpb, max_tokens_per_call=16)
    rt = Runtime(mgr)
    rt.add("a", stored)
    rt.remove("a")
    prompt = (stored + extra)[:15]
    hit = mgr.lookup(prompt, max_hit_tokens=cap).hit_tokens
    assert hit <= min(cap, len(prompt)) and hit % tpb == 0
    assert rt.add("b", prompt, max_hit_tokens=cap) == hit  # checks the rows handed out
    mgr.check_invariants()
    rt.add_tokens("b", [9])
    rt.remove("b")
