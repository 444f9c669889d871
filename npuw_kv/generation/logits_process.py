"""What happens to a logits row before a token is chosen: penalties, masks, constraints.

The order and the formulas are openvino-genai's (``sampling/logit_processor.hpp``), so a config
gives the same tokens here as there: stop tokens masked until ``min_new_tokens``, the
repetition penalty (prompt and output), the presence and frequency penalties (output only),
then ours beyond genai: ``no_repeat_ngram_size`` (genai applies it in beam search only) and a
structured-output :class:`LogitsConstraint`.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol, runtime_checkable

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..api.config_checks import limit
from ..api.generation_config import GenerationConfig


@runtime_checkable
class LogitsConstraint(Protocol):
    """Restricts which tokens may come next (e.g. a grammar for structured output)."""

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """A copy of ``logits`` with the disallowed tokens at -inf."""
        ...

    def accept(self, token: int) -> None:
        """Advance past the chosen ``token``."""
        ...

    def done(self) -> bool:
        """True when nothing more may be generated (generation then ends with "stop")."""
        ...


class LogitsProcessor:
    """Penalties and masks over one sequence; :meth:`accept` each chosen token."""

    def __init__(self, config: GenerationConfig, prompt: np.ndarray | None = None) -> None:
        self.config = config
        ids = [] if prompt is None else [int(t) for t in np.asarray(prompt).reshape(-1)]
        self.prompt = set(ids)
        self.history = ids  # prompt + output, for no_repeat_ngram_size
        self.counts: Counter[int] = Counter()  # output tokens
        self.generated = 0
        self.stop_ids = np.array(sorted(config.stop_ids()), np.int64)

    def accept(self, token: int) -> None:
        self.counts[token] += 1
        self.generated += 1
        self.history.append(token)

    def __call__(
        self, logits: np.ndarray, constraint: LogitsConstraint | None = None
    ) -> np.ndarray:
        """A float32 copy of ``logits`` with everything applied."""
        cfg = self.config
        out = np.array(logits, np.float32, copy=True).reshape(-1)
        if self.generated < cfg.min_new_tokens:
            stop = self.stop_ids[self.stop_ids < out.size]
            out[stop] = -np.inf
        if cfg.repetition_penalty != 1.0:
            self._scale(out, self.prompt | set(self.counts), cfg.repetition_penalty)
        if cfg.presence_penalty or cfg.frequency_penalty:
            self._shift(out)
        ngram = limit(cfg.no_repeat_ngram_size)
        if ngram:
            out[self.banned_ngram_ends(ngram)] = -np.inf
        if constraint is not None:
            out = np.asarray(constraint.apply(out), np.float32)
        return out

    @staticmethod
    def _scale(out: np.ndarray, seen: set[int], penalty: float) -> None:
        """CTRL-style (as transformers / genai): positive logits divided, negative ones
        multiplied, once per token whether seen once or often."""
        idx = np.fromiter(seen, np.int64, len(seen))
        idx = idx[(idx >= 0) & (idx < out.size)]
        vals = out[idx]
        out[idx] = np.where(vals >= 0, vals / penalty, vals * penalty)

    def _shift(self, out: np.ndarray) -> None:
        """genai's presence, then frequency penalty: each output token's logit moves toward
        zero by ``presence``, then by ``frequency * count`` (so a negative logit rises, unlike
        OpenAI's where every logit falls; kept so that results match genai's)."""
        cfg = self.config
        idx = np.fromiter(self.counts.keys(), np.int64, len(self.counts))
        counts = np.fromiter(self.counts.values(), np.float32, len(self.counts))
        keep = (idx >= 0) & (idx < out.size)
        idx, counts = idx[keep], counts[keep]
        for shift in (np.float32(cfg.presence_penalty), np.float32(cfg.frequency_penalty) * counts):
            vals = out[idx]
            out[idx] = np.where(vals >= 0, vals - shift, vals + shift)

    def banned_ngram_ends(self, n: int) -> np.ndarray:
        """Tokens that would repeat an n-gram of prompt + output (as transformers' and genai's
        beam search): those that followed an earlier occurrence of the last n-1 tokens."""
        return banned_ngram_ends(self.history, n)


def banned_ngram_ends(tokens: list[int], n: int) -> np.ndarray:
    """Tokens that would repeat an n-gram of ``tokens`` (also beam search's, per beam)."""
    history = np.asarray(tokens, np.int64)
    if history.size < n:
        return np.zeros(0, np.int64)
    if n == 1:
        return np.unique(history)
    windows = sliding_window_view(history[:-1], n - 1)
    hits = np.flatnonzero((windows == history[history.size - n + 1 :]).all(axis=1))
    return history[hits + n - 1]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities of a logits row, in float64."""
    x = np.asarray(logits, np.float64)
    top = x.max()
    return x - top - np.log(np.exp(x - top).sum())
