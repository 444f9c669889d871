"""What the attention type of a window group decides in the block manager.

Full attention and a sliding window differ in a handful of choices: whether a prefix hit's
blocks can be shared by live sequences, when blocks enter the reuse tree, what evicting a cached
block does to its descendants, in which order a finished sequence releases its blocks, and
whether reclaiming a block spoils its last owner's store.  Each window's manager asks its policy
(:func:`policy_for`) instead of testing ``is_swa`` where it acts (vLLM v1 has one manager class
per attention type for the same reason).
"""

from __future__ import annotations

from collections.abc import Iterable


class FullAttention:
    """Every token reads every earlier one: a block, once full, never changes for anyone."""

    name = "full"
    #: a prefix hit's blocks are shared by reference count (nobody writes them again)
    shares_hit_blocks = True
    #: blocks enter the reuse tree as they fill, so concurrent sequences can hit them at once
    stores_while_filling = True
    #: a hit needs every block of the prefix: evicting one cuts its descendants from the tree
    cut_on_evict = True
    #: a detached block is never kept for a later store (full attention detaches nothing)
    keeps_detached_for_store = False
    #: handing a block to another sequence never spoils its last owner's store
    reclaim_invalidates_owner = False
    #: block slots beyond max_seq_len's (a window's writes may straddle one more block)
    extra_blocks_per_seq = 0

    @staticmethod
    def release_order(blocks: range) -> Iterable[int]:
        """A finished sequence's tail goes into the LRU queue first, so a cached chain shrinks
        from its end (evicting its first block would cut every block after it)."""
        return reversed(blocks)


class SlidingWindow:
    """Each token reads the last ``window`` ones: a sequence detaches blocks behind its window,
    and a deep hit needs only the blocks just before it."""

    name = "sliding window"
    #: live blocks are never shared: a hit's blocks are copied into the sequence's own
    shares_hit_blocks = False
    #: blocks are stored only when the sequence ends, if none was handed to another meanwhile
    stores_while_filling = False
    #: a hit needs only the trailing blocks: an evicted block leaves a hollow node behind
    cut_on_evict = False
    #: detached blocks that still hold their rows stay cached until the sequence stores them
    keeps_detached_for_store = True
    #: a block handed to another sequence invalidates its last owner's store (TRT-LLM's rule)
    reclaim_invalidates_owner = True
    extra_blocks_per_seq = 1

    @staticmethod
    def release_order(blocks: range) -> Iterable[int]:
        """The front goes first: it is what a later hit is least likely to need."""
        return blocks


Policy = type[FullAttention] | type[SlidingWindow]


def policy_for(is_swa: bool) -> Policy:
    """The policy of a window group (sliding when its window is shorter than max_seq_len)."""
    return SlidingWindow if is_swa else FullAttention
