"""Taking a primary block for a call, and what becomes of the bytes it held.

A victim worth keeping (cached, or a detached sliding-window block its live owner may still
store) moves to the host pool when its priority allows and the host has room; otherwise its
bytes are forgotten: it leaves the reuse tree, its last owner can no longer store its chain, and
its generation moves on so every table slot that recorded the old one reads as stale. The rules
are in docs/design.md, "Choices inside one window group".
"""

from __future__ import annotations

from collections.abc import Callable

from .block import EMPTY_LEVEL, KVBlock, PoolKind
from .pool import BlockPool, SlotCopier, move_bytes
from .reuse_tree import ReuseTree
from .sequence import SeqBlocks
from .stats import WindowCounters


class Reclaimer:
    """Free-block policy of one window group; shares its pools, tree and sequences."""

    def __init__(
        self,
        pools: dict[PoolKind, BlockPool],
        *,
        tree: ReuseTree | None,
        seqs: dict[int, SeqBlocks],
        counters: WindowCounters,
        copy: SlotCopier,
        emit_move: Callable[[str, KVBlock], None],
        default_priority: int,
        offload_min_priority: int,
    ) -> None:
        self.pools = pools
        self.primary, self.host = pools[PoolKind.PRIMARY], pools[PoolKind.HOST]
        self.tree = tree
        self.seqs = seqs
        self.counters = counters
        self._copy = copy
        self._emit_move = emit_move
        self.invalidates_owner = self.primary.group.policy.reclaim_invalidates_owner
        self.default_priority = default_priority
        self.offload_min_priority = offload_min_priority

    def take_free_primary(self, serial: int, index: int) -> KVBlock:
        """``get_free_block``: reclaim a primary block for block ``index`` of sequence
        ``serial``, offloading the victim if it is worth it."""
        level = self.primary.queue.peek_level()
        victim = self.primary.queue.pop_victim()
        host_level = self.host.queue.peek_level()
        if (
            level is not None
            and level != EMPTY_LEVEL
            and victim.priority >= self.offload_min_priority
            and host_level is not None
            and host_level <= level  # room: never drop a more valuable host block for it
        ):
            empty = self.host.queue.pop_victim()
            self._reset(empty)  # may cut the victim from the tree or invalidate its owner
            if self._worth_keeping(victim):
                move_bytes(victim, empty, self._copy)
                self.host.queue.push(victim, level)
                self.counters.offloads += 1
                self._emit_move("offloaded", victim)
                victim = empty
            else:
                self.host.queue.push(empty, EMPTY_LEVEL)
                self._reset(victim, serial)
        else:
            self._reset(victim, serial)
        victim.last_owner = serial
        victim.position = index
        return victim

    def uncache(self, block: KVBlock) -> None:
        """Take ``block`` out of the reuse tree; blocks cut off with it become worthless."""
        assert self.tree is not None
        for lost in self.tree.evict(block):
            if lost.queue_level is not None and lost.queue_level != EMPTY_LEVEL:
                self.pools[lost.pool].queue.requeue(lost, EMPTY_LEVEL)

    def drop_kept(self, seq: SeqBlocks) -> None:
        """Requeue as worthless the detached, uncached blocks ``seq`` kept only to store them."""
        for j, b in enumerate(seq.table[: seq.first_live]):
            level = None if b is None or b.node is not None else b.queue_level
            if b is not None and level not in (None, EMPTY_LEVEL) and seq.holds_bytes(j):
                self.pools[b.pool].queue.requeue(b, EMPTY_LEVEL)

    def _worth_keeping(self, block: KVBlock) -> bool:
        """Cached, or a detached SWA block its live owner may still store."""
        if block.node is not None:
            return True
        owner = self.seqs.get(block.last_owner) if block.last_owner is not None else None
        index = block.position
        return (
            owner is not None
            and index is not None
            and index < owner.storable_upto(index + 1)
            and self.tree is not None
        )

    def _reset(self, block: KVBlock, taker: int | None = None) -> None:
        """Forget what ``block`` held: drop it from the tree, invalidate its last owner, and
        bump its generation so every table slot that recorded the old one reads as stale
        (its bytes are about to be overwritten, or are no longer anyone's).

        The owner is not invalidated when it is the ``taker``: a sequence that gets its own
        detached block back loses only that slot's bytes (``holds_bytes``), and its later blocks
        can still be stored.
        """
        if block.node is not None:
            self.uncache(block)
        owner = self.seqs.get(block.last_owner) if block.last_owner is not None else None
        if (
            owner is not None
            and owner.storable
            and self.invalidates_owner
            and owner.serial != taker
        ):
            self._invalidate(owner)
        block.gen += 1
        block.last_owner = None
        block.position = None
        block.priority = self.default_priority

    def _invalidate(self, seq: SeqBlocks) -> None:
        """Mark ``seq`` unstorable; its kept detached blocks become worthless at once, so they
        are reclaimed before any cached block."""
        seq.storable = False
        self.counters.invalidated_sequences += 1
        self.drop_kept(seq)
