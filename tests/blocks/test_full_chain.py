"""A full-attention sequence's chain, cut from the tree while it lives, is cached again."""

from __future__ import annotations

import pytest
from blocks_helpers import build

pytestmark = pytest.mark.unit  # builds no model (the quick tier)


def test_chain_cut_by_evicting_a_cached_ancestor_is_stored_when_the_sequence_ends() -> None:
    """s computes [1, 2] privately (reuse off) while x's copy is cached, so s's [3, 4] hangs
    under x's block; evicting x's block cuts it. s still holds every byte, so when it ends its
    whole chain must be cached again."""
    m = build([None], [4], max_seq_len=8, tpb=2)
    m.add_sequence("x", [1, 2, 3])
    m.remove_sequence("x")  # caches [1, 2]
    m.add_sequence("s", [1, 2, 3, 4, 5], reuse=False)
    m.add_sequence("t", [7])  # the only free block is x's: evicted, s's [3, 4] cut with it
    m.remove_sequence("t")
    m.check_invariants()
    m.remove_sequence("s")
    m.check_invariants()
    assert m.lookup([1, 2, 3, 4, 5]).hit_tokens == 4


def test_cut_chain_is_stored_again_on_the_next_call() -> None:
    m = build([None], [5], max_seq_len=10, tpb=2)
    m.add_sequence("x", [1, 2, 3])
    m.remove_sequence("x")
    m.add_sequence("s", [1, 2, 3, 4], reuse=False)
    m.add_sequence("t", [7, 8, 9, 10, 11])  # the two empty blocks, then x's: s's chain is cut
    m.remove_sequence("t")
    assert m.lookup([1, 2, 3, 4, 5]).hit_tokens == 0
    m.add_tokens("s", [5])  # no new full block, but the chain goes back into the tree
    assert m.lookup([1, 2, 3, 4, 5]).hit_tokens == 4
    m.check_invariants()
