"""The prompt's own log-probabilities (genai's ``echo`` with ``logprobs``; OpenAI's and vLLM's
``echo`` with ``logprobs``): what lm-eval's loglikelihood and multiple-choice tasks score.

Each prompt token after the first is scored by the logits row of the token before it, as the
prefill computes it: the paged path asks its model for every row of the chunks that read the
prompt (the LM head gathers the rows it is given); the static-shape path (the NPU's) takes them
from its prefill models where they keep the head on every row (``full_prefill_logits``), else
it feeds the prompt token by token through its generate model
(``Runner.prefill_every_row``).  Log-probabilities are the raw
model's (before penalties, temperature and sampling filters), as the generated tokens' are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import UsageError

MISSING_ROWS = "prompt log-probabilities (echo with logprobs): the prefill gave no logits for"


def wanted(config: Any) -> bool:
    """Whether a call scores its prompt: ``echo`` with ``logprobs`` > 0."""
    return bool(config.echo) and int(config.logprobs) > 0


def check(config: Any) -> None:
    """Refuse, by name, a call that scores its prompt where that cannot be done."""
    if wanted(config) and config.num_beams > 1:
        raise UsageError(
            "echo with logprobs (prompt log-probabilities) takes greedy or sampled decoding, "
            f"not beam search (num_beams={config.num_beams})"
        )


class PromptScores:
    """Log-probability and ``top`` likeliest alternatives of each prompt token, from the
    prefill's logits rows as they come (by position: a sequence read again after a preemption
    writes the same values again)."""

    def __init__(self, ids: Sequence[int] | np.ndarray, top: int) -> None:
        self.ids = [int(t) for t in ids]
        self.top = max(int(top), 1)
        n = len(self.ids)
        self.logprobs: list[float | None] = [None] * n  # the first stays None: nothing predicts it
        self.tops: list[list[tuple[int, float]]] = [[] for _ in range(n)]
        self._missing = set(range(1, n))

    @property
    def complete(self) -> bool:
        return not self._missing

    def add(self, positions: np.ndarray, logits: np.ndarray) -> None:
        """Rows of logits at prompt ``positions``: the row at p scores token p + 1.  A chunk's
        rows at once (a row at a time in numpy costs more than the head that made them): the
        exponentials in the rows' float32, their sums and the log-probabilities in float64."""
        targets = np.asarray(positions, np.int64).reshape(-1) + 1
        keep = (targets > 0) & (targets < len(self.ids))
        if not keep.any():
            return
        rows, targets = np.asarray(logits)[keep], targets[keep]
        peak = rows.max(axis=1, keepdims=True)
        total = np.exp(rows - peak).sum(axis=1, dtype=np.float64)
        lse = np.log(total) + peak[:, 0].astype(np.float64)  # log of each row's normalizer
        chosen = rows[np.arange(len(rows)), np.asarray(self.ids)[targets]] - lse
        best = _likeliest(rows, min(self.top, rows.shape[1]))
        values = np.take_along_axis(rows, best, axis=1) - lse[:, None]
        for target, logprob, ids, logs in zip(
            targets.tolist(), chosen.tolist(), best.tolist(), values.tolist(), strict=True
        ):
            self.logprobs[target] = logprob
            self.tops[target] = list(zip(ids, logs, strict=True))
            self._missing.discard(target)

    def check_complete(self) -> None:
        """A prefill that gave fewer rows than the prompt has (a path that cannot) is an
        error, never a silent hole."""
        if self._missing:
            raise UsageError(f"{MISSING_ROWS} {len(self._missing)} prompt rows")


def _likeliest(rows: np.ndarray, k: int) -> np.ndarray:
    """Each row's ``k`` largest entries' columns, largest first (the lowest column first among
    equal ones, as a stable sort): by repeated argmax for the few alternatives an API asks for
    (numpy's argpartition over a vocabulary is far slower), by a partition beyond."""
    if k > 8:
        best = np.argpartition(-rows, k - 1, axis=1)[:, :k]
        order = np.lexsort((best, -np.take_along_axis(rows, best, axis=1)), axis=1)
        return np.take_along_axis(best, order, axis=1)
    left = rows.copy() if k > 1 else rows
    every = np.arange(len(rows))
    best = np.empty((len(rows), k), np.int64)
    for j in range(k):
        best[:, j] = left.argmax(axis=1)
        if j + 1 < k:
            left[every, best[:, j]] = -np.inf
    return best
