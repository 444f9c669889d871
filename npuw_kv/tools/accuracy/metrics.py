"""Agreement and distance between two runs' tokens and next-token distributions."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def first_divergence(ours: Sequence[int], ref: Sequence[int]) -> int | None:
    """Index of the first generated token that differs (None if one is a prefix of the other)."""
    for i, (a, b) in enumerate(zip(ours, ref, strict=False)):
        if a != b:
            return i
    return None


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl_divergence(ref_logits: np.ndarray, our_logits: np.ndarray) -> np.ndarray:
    """KL(ref || ours) per row, in nats."""
    p_log, q_log = log_softmax(ref_logits), log_softmax(our_logits)
    return (np.exp(p_log) * (p_log - q_log)).sum(axis=-1)


def nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood of ``targets[i]`` under ``logits[i]``, per row.  Callers feed
    a long prompt's rows a chunk at a time: the float64 log-softmax of 4k rows of a 262k
    vocabulary would take 8 GB.  Only each row's log-sum-exp is needed, so it is computed in
    place in one float64 copy instead of a whole log-softmax (four copies)."""
    x = logits.astype(np.float64)
    top = x.max(axis=-1, keepdims=True)
    picked = x[np.arange(len(targets)), np.asarray(targets)] - top[:, 0]
    x -= top
    np.exp(x, out=x)
    return np.log(x.sum(axis=-1)) - picked


def perplexity(nlls: Sequence[np.ndarray]) -> float:
    """exp(mean NLL) over the rows of every piece of :func:`nll` (nan for none)."""
    values = np.concatenate(nlls) if nlls else np.empty(0)
    return float(np.exp(values.mean())) if values.size else float("nan")


def lead_at(
    ref_logits: np.ndarray, ref_tokens: list[int], chosen: list[int], position: int | None
) -> float:
    """The reference's logit for its token minus its logit for ``chosen`` at ``position``."""
    if position is None or position >= min(len(ref_logits), len(chosen)):
        return float("nan")
    row = ref_logits[position]
    return float(row[ref_tokens[position]] - row[chosen[position]])
