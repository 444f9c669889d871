"""The inputs that let one PagedAttention call check a tree of candidate tokens.

OpenVINO's ``PagedAttentionExtension`` takes a query-to-query mask (``qq_bias``, u8, one
``n x n`` square per sequence that has one, flattened; ``qq_bias_begins`` the offsets, one per
sequence and one past the end) when the model was rewritten with ``allow_qq_bias``: token i of
the call attends to the cached tokens and to the call's tokens j with ``mask[i, j] = 1``.
A token's position is its depth, so siblings share one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

TREE_MASK, TREE_MASK_BEGINS = "qq_bias", "qq_bias_begins"


def attention_mask(parents: Sequence[int]) -> np.ndarray:
    """``[n, n]`` u8: row i marks itself and its ancestors (``parents[i] < i``; -1: none)."""
    n = len(parents)
    mask = np.zeros((n, n), np.uint8)
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"token {i}'s parent must come before it, got {p}")
        mask[i, i] = 1
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def depths(parents: Sequence[int]) -> np.ndarray:
    """Each token's distance from the cached tokens (0: it follows them directly)."""
    out = np.zeros(len(parents), np.int64)
    for i, p in enumerate(parents):
        out[i] = 0 if p < 0 else out[p] + 1
    return out


def positions(
    pasts: Sequence[int], lengths: Sequence[int], parents: Sequence[int] | None
) -> np.ndarray:
    """The position of every token of a call: after its sequence's cached tokens, in order;
    in a tree (``parents``: one sequence's call), at its depth."""
    if parents is None:
        spans = zip(pasts, lengths, strict=True)
        return np.concatenate([np.arange(p, p + n, dtype=np.int64) for p, n in spans])
    if len(pasts) != 1 or len(parents) != lengths[0]:
        raise ValueError("a tree is one sequence's call, with a parent per token")
    return pasts[0] + depths(parents)


def mask_inputs(parts: int, parents: Sequence[int] | None) -> dict[str, np.ndarray]:
    """The mask inputs of a call: none checks a tree, or its lone sequence's tree does."""
    if parents is None:
        return {
            TREE_MASK: np.zeros(0, np.uint8),
            TREE_MASK_BEGINS: np.zeros(parts + 1, np.int32),
        }
    mask = attention_mask(parents)
    return {TREE_MASK: mask.reshape(-1), TREE_MASK_BEGINS: np.array([0, mask.size], np.int32)}
