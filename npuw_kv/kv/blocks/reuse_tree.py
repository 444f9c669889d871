"""Radix tree of full blocks for prefix reuse.

A node (``TreeNode``, in ``block.py``) stands for one full block of ``tokens_per_block`` tokens
at a given depth; its children are keyed by their tokens, and its ``block_hash`` chains the
parent's hash with its tokens, so equal hashes mean equal prefixes (the key comparison makes
collisions harmless).

Nodes may be *hollow* (no block) in sliding-window groups: when the first blocks of a long
conversation are evicted, the later ones are still useful because an SWA hit only needs the
trailing ``ceil((window-1)/tpb)`` blocks before the hit point. Hollow nodes are kept only while
they lead to a node with data; a hollow leaf is pruned at once.

In full-attention groups a hit needs every block of the prefix, so evicting a block makes its
whole subtree unreachable: ``evict`` cuts the subtree off and returns the blocks that lost their
place, so the caller can mark them worthless. Nodes that are cut are flagged ``attached=False``
so stale pointers held by sequences are detected.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from .block import KVBlock, TreeNode

#: (kind, block_hash, parent_hash, num_tokens); kind is "stored" or "removed"
EventSink = Callable[[str, int, int, int], None]


def chain_hash(parent_hash: int, key: tuple[int, ...]) -> int:
    """Hash of a block given its parent's hash (deterministic across runs)."""
    return hash((parent_hash, key))


class ReuseTree:
    """The reuse tree of one window group."""

    def __init__(self, tokens_per_block: int, cut_on_evict: bool, sink: EventSink) -> None:
        self.tpb = tokens_per_block
        self.cut_on_evict = cut_on_evict
        self.root = TreeNode((), None, 0)
        self._sink = sink
        self.cached_blocks = 0  # nodes holding a block

    def key_at(self, tokens: Sequence[int], index: int) -> tuple[int, ...]:
        return tuple(tokens[index * self.tpb : (index + 1) * self.tpb])

    def walk(self, tokens: Sequence[int], max_blocks: int) -> list[TreeNode]:
        """Nodes matching the first full blocks of ``tokens`` (hollow ones included)."""
        path: list[TreeNode] = []
        node = self.root
        for i in range(max_blocks):
            child = node.children.get(self.key_at(tokens, i))
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def get_or_create(self, parent: TreeNode, key: tuple[int, ...]) -> TreeNode:
        child = parent.children.get(key)
        if child is None:
            child = parent.children[key] = TreeNode(key, parent, chain_hash(parent.block_hash, key))
        return child

    def attach(self, node: TreeNode, block: KVBlock) -> None:
        """Cache ``block`` at ``node`` (which must be hollow)."""
        if node.block is not None or block.node is not None or not node.attached:
            raise RuntimeError(f"cannot attach {block} at {node}")
        node.block = block
        block.node = node
        self.cached_blocks += 1
        parent_hash = node.parent.block_hash if node.parent is not None else 0
        self._sink("stored", node.block_hash, parent_hash, len(node.key))

    def evict(self, block: KVBlock) -> list[KVBlock]:
        """Remove ``block`` from the tree; return other blocks that lost their place."""
        node = block.node
        if node is None or node.block is not block:
            raise RuntimeError(f"{block} is not cached in this tree")
        self._drop_block(node)
        lost: list[KVBlock] = []
        if self.cut_on_evict:
            for child in list(node.children.values()):
                lost.extend(self._cut(child))
            node.children.clear()
        self.prune(node)
        return lost

    def _drop_block(self, node: TreeNode) -> None:
        block = node.block
        assert block is not None
        node.block = None
        block.node = None
        self.cached_blocks -= 1
        parent_hash = node.parent.block_hash if node.parent is not None else 0
        self._sink("removed", node.block_hash, parent_hash, len(node.key))

    def _cut(self, top: TreeNode) -> list[KVBlock]:
        """Detach the subtree under ``top`` (iteratively: chains can be thousands deep)."""
        lost: list[KVBlock] = []
        stack = [top]
        while stack:
            node = stack.pop()
            node.attached = False
            if node.block is not None:
                lost.append(node.block)
                self._drop_block(node)
            stack.extend(node.children.values())
            node.children.clear()
        return lost

    def prune(self, node: TreeNode) -> None:
        """Remove hollow leaves from ``node`` upwards."""
        while (
            node.parent is not None and node.block is None and not node.children and node.attached
        ):
            parent = node.parent
            del parent.children[node.key]
            node.attached = False
            node = parent

    def nodes(self) -> Iterator[TreeNode]:
        """Every node below the root (depth-first, iterative)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
