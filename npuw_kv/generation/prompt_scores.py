"""The prompt's own log-probabilities (genai's ``echo`` with ``logprobs``; OpenAI's and vLLM's
``echo`` with ``logprobs``): what lm-eval's loglikelihood and multiple-choice tasks score.

Each prompt token after the first is scored by the logits row of the token before it, as the
prefill computes it: the paged path asks its model for every row of the chunks that read the
prompt (the LM head gathers the rows it is given), the static-shape path has them only when
the model keeps the head on every row (``full_prefill_logits``).  Log-probabilities are the raw
model's (before penalties, temperature and sampling filters), as the generated tokens' are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import UsageError
from .logits_process import log_softmax

STATIC_PATH = (
    "prompt log-probabilities (echo with logprobs) on the static-shape path need every prompt "
    "row's logits: build the pipeline with full_prefill_logits=YES, or run on the CPU's "
    "PagedAttention path (attention_backend='pa')"
)


def wanted(config: Any) -> bool:
    """Whether a call scores its prompt: ``echo`` with ``logprobs`` > 0."""
    return bool(config.echo) and int(config.logprobs) > 0


def check(config: Any, *, paged: bool, full_logits: bool) -> None:
    """Refuse, by name, a call that scores its prompt where that cannot be done."""
    if not wanted(config):
        return
    if config.num_beams > 1:
        raise UsageError(
            "echo with logprobs (prompt log-probabilities) takes greedy or sampled decoding, "
            f"not beam search (num_beams={config.num_beams})"
        )
    if not paged and not full_logits:
        raise UsageError(STATIC_PATH)


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
        """Rows of logits at prompt ``positions``: the row at p scores token p + 1."""
        n = len(self.ids)
        for p, row in zip(np.asarray(positions).tolist(), logits, strict=True):
            target = int(p) + 1
            if not 0 < target < n:
                continue
            raw = log_softmax(row)
            self.logprobs[target] = float(raw[self.ids[target]])
            k = min(self.top, raw.size)
            best = np.argpartition(-raw, k - 1)[:k]
            best = best[np.argsort(-raw[best], kind="stable")]
            self.tops[target] = [(int(t), float(raw[t])) for t in best]
            self._missing.discard(target)

    def check_complete(self) -> None:
        """A prefill that gave fewer rows than the prompt has (a path that cannot) is an
        error, never a silent hole."""
        if self._missing:
            raise UsageError(f"{STATIC_PATH} ({len(self._missing)} prompt rows had no logits)")
