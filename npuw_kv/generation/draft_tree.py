"""A tree of candidate tokens for speculative decoding (``tree_depth`` / ``branching_factor``).

A chain of candidates is lost at its first miss; a tree keeps the draft's runners-up, so the
main model, checking every node in one call, finds a longer accepted path.  The tree grows as
openvino-genai documents its tree search: the root is the token just chosen; each of
``tree_depth`` layers gives every node kept in the layer before its ``branching_factor``
likeliest next tokens, and of those the ``branching_factor`` with the highest path
log-probability are kept to grow the next layer; at the end the ``num_assistant_tokens`` nodes
with the highest path log-probability are checked.

The nodes are put in depth-first order with each node's likelier child first, so the draft's
favourite path sits in consecutive cache slots after the root: when the main model accepts
along it, its KV is already where plain decoding would have written it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .logits_process import log_softmax


@dataclass(frozen=True)
class CandidateTree:
    """Candidate tokens and each one's parent (an index into ``tokens``; -1: the root)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError("a candidate tree needs one parent per token")
        if any(not -1 <= p < i for i, p in enumerate(self.parents)):
            raise ValueError(f"each parent must come before its child: {self.parents}")

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> CandidateTree:
        """Candidates one after another (prompt lookup, a greedy draft)."""
        return cls(tuple(int(t) for t in tokens), tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def child(self, node: int, token: int) -> int | None:
        """The child of ``node`` (-1: the root) that holds ``token``; None: no such child."""
        for i, (t, p) in enumerate(zip(self.tokens, self.parents, strict=True)):
            if p == node and t == token:
                return i
        return None


@dataclass
class _Node:
    token: int
    parent: int  # index into the list of nodes grown; -1: the root
    score: float  # log-probability of the path from the root to this node
    layer: int


# the draft's logits after every node of a tree (each after its own path), one row each
Expand = Callable[[CandidateTree], np.ndarray]


def grow_tree(
    root_logits: np.ndarray, expand: Expand, depth: int, branching: int, size: int
) -> CandidateTree:
    """The tree described in the module docstring, at most ``size`` nodes.

    ``expand(tree)`` runs the draft over the paths to the nodes kept in the last layer.
    """
    nodes: list[_Node] = []
    frontier = [(-1, log_softmax(root_logits), 0.0)]
    for layer in range(1, depth + 1):
        grown: list[int] = []
        for parent, logp, score in frontier:
            for token in _top(logp, branching):
                nodes.append(_Node(int(token), parent, score + float(logp[token]), layer))
                grown.append(len(nodes) - 1)
        if layer == depth:
            break
        kept = sorted(grown, key=lambda i: -nodes[i].score)[:branching]
        call, rows = _paths(nodes, kept)
        logits = expand(call)
        frontier = [(i, log_softmax(logits[rows[i]]), nodes[i].score) for i in kept]
    return _checked(nodes, size)


def _paths(nodes: list[_Node], kept: list[int]) -> tuple[CandidateTree, dict[int, int]]:
    """The kept nodes with their ancestors, as a tree in growing order; where each node is."""
    members: set[int] = set()
    for node in kept:
        while node >= 0 and node not in members:
            members.add(node)
            node = nodes[node].parent
    order = sorted(members)  # a parent is grown before its children
    where = {node: k for k, node in enumerate(order)}
    tree = CandidateTree(
        tuple(nodes[i].token for i in order),
        tuple(where[nodes[i].parent] if nodes[i].parent >= 0 else -1 for i in order),
    )
    return tree, where


def _top(logp: np.ndarray, k: int) -> list[int]:
    """The k likeliest tokens, likeliest first (ties: the lower id, as argmax)."""
    k = min(k, logp.size)
    kth = np.partition(logp, logp.size - k)[logp.size - k]
    tied = np.flatnonzero(logp >= kth)  # every token tied with the k-th, to pick by id
    return sorted(tied.tolist(), key=lambda t: (-logp[t], t))[:k]


def _checked(nodes: list[_Node], size: int) -> CandidateTree:
    """The ``size`` best nodes (a path's score never grows, so they hold their ancestors; a
    tie that would orphan one is dropped), in depth-first order, the likelier child first."""
    ranked = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].layer, i))
    chosen: set[int] = set()
    for i in sorted(ranked[:size], key=lambda i: nodes[i].layer):
        if nodes[i].parent < 0 or nodes[i].parent in chosen:
            chosen.add(i)
    children: dict[int, list[int]] = {}
    for i in sorted(chosen, key=lambda i: (-nodes[i].score, i)):
        children.setdefault(nodes[i].parent, []).append(i)
    order: list[int] = []
    stack = list(reversed(children.get(-1, [])))
    while stack:
        i = stack.pop()
        order.append(i)
        stack.extend(reversed(children.get(i, [])))
    where = {node: k for k, node in enumerate(order)}
    return CandidateTree(
        tuple(nodes[i].token for i in order),
        tuple(where.get(nodes[i].parent, -1) for i in order),
    )


def in_place(path: Sequence[int]) -> int:
    """How many of an accepted path's nodes sit where plain decoding would have written their
    KV: node i of the depth-first order is written i slots after the root."""
    count = 0
    while count < len(path) and path[count] == count:
        count += 1
    return count
