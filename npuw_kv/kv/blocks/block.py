"""One KV cache block: the unit the pools hand out, the tree caches and the policy evicts.

A block object is a *logical* block: its identity (tree node, refcount, priority, last owner)
stays with it when its bytes move between the primary and the host pool (so does ``gen``:
moving bytes does not change them). Offload and onboard
swap the physical location (``pool``, ``slot``) of two block objects after copying the bytes,
so a cached block keeps its place in the reuse tree wherever its bytes live.

The block's hash and tokens live on its tree node (``node``): a block outside the tree has no
reusable identity, which is exactly when its contents may be overwritten.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .reuse_tree import TreeNode

#: Priorities are integers in [MIN_PRIORITY, MAX_PRIORITY]; higher survives longer.
MIN_PRIORITY = 0
MAX_PRIORITY = 100
DEFAULT_PRIORITY = 35
#: Queue level of blocks whose contents are worthless; always reclaimed first.
EMPTY_LEVEL = -1


class PoolKind(Enum):
    """Which part of a window's pool holds a block's bytes."""

    PRIMARY = "primary"
    HOST = "host"


@dataclass(eq=False, slots=True)
class KVBlock:
    """A block of ``tokens_per_block`` token rows for all layers of one window group."""

    block_id: int
    pool: PoolKind
    slot: int
    ref_count: int = 0
    priority: int = DEFAULT_PRIORITY
    #: serial of the sequence whose data the block last received (set by allocation or claim)
    last_owner: int | None = None
    #: reuse-tree node holding this block, ``None`` when the block is not cached
    node: TreeNode | None = None
    #: level in its pool's eviction queue, ``None`` while not reclaimable (in use or pinned)
    queue_level: int | None = None
    #: bumped each time the block is reset (handed out by the free-block path, or emptied
    #: in the host pool to make room for an offload): its bytes are no longer what any table
    #: slot recorded. A slot remembers the generation it took, so a stale slot is never stored
    gen: int = 0
    #: block index (in a sequence) whose tokens the bytes hold; ``None`` once they are stale.
    #: Lets ``check_invariants`` catch a block cached or read at a position it was not written for
    position: int | None = None

    @property
    def block_hash(self) -> int | None:
        """Chained hash of the cached prefix ending with this block (``None`` if not cached)."""
        return None if self.node is None else self.node.block_hash

    @property
    def tokens(self) -> tuple[int, ...]:
        """Token ids this block caches (empty if not cached)."""
        return () if self.node is None else self.node.key

    def __repr__(self) -> str:
        return (
            f"KVBlock(id={self.block_id}, {self.pool.value}[{self.slot}], ref={self.ref_count}, "
            f"prio={self.priority}, owner={self.last_owner}, cached={self.node is not None}, "
            f"level={self.queue_level}, gen={self.gen})"
        )
