"""One KV cache block (the unit the pools hand out, the tree caches and the policy evicts) and
the reuse-tree node that caches it.

A block object is a *logical* block: its identity (tree node, refcount, priority, last owner)
stays with it when its bytes move between the primary and the host pool (so does ``gen``:
moving bytes does not change them). Offload and onboard
swap the physical location (``pool``, ``slot``) of two block objects after copying the bytes,
so a cached block keeps its place in the reuse tree wherever its bytes live.

The block's hash and tokens live on its tree node (``node``): a block outside the tree has no
reusable identity, which is exactly when its contents may be overwritten. A block points at its
node and a node at its block, so both types live here; the tree that links the nodes
(``reuse_tree.py``) builds on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

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


class TreeNode:
    """One full block position in the reuse tree: the tokens it is keyed by, the chained hash of
    the prefix ending with it, and the block holding its bytes (``None``: hollow)."""

    __slots__ = ("key", "block_hash", "parent", "children", "block", "attached", "depth")

    def __init__(self, key: tuple[int, ...], parent: TreeNode | None, block_hash: int) -> None:
        self.key = key
        self.parent = parent
        self.depth: int = 0 if parent is None else parent.depth + 1
        self.block_hash = block_hash
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.block: KVBlock | None = None
        self.attached = True

    def __repr__(self) -> str:
        return f"TreeNode(depth={self.depth}, hash={self.block_hash}, block={self.block})"
