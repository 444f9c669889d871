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


def perplexity(logits: np.ndarray, targets: np.ndarray) -> float:
    """exp(mean NLL) of ``targets[i]`` under ``logits[i]``."""
    if len(logits) == 0:
        return float("nan")
    logp = log_softmax(logits)
    nll = -logp[np.arange(len(targets)), np.asarray(targets)]
    return float(np.exp(nll.mean()))
