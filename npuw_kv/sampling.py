"""Next-token selection from one logits row: greedy, or temperature / top-k / top-p sampling."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np


@dataclass
class GenerationConfig:
    """Per-call generation settings, named as in ``openvino_genai.GenerationConfig``."""

    max_new_tokens: int = 128
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    rng_seed: int | None = None
    stop_strings: set[str] = field(default_factory=set)
    ignore_eos: bool = False
    eos_token_id: int | None = None
    apply_chat_template: bool = True  # text prompts go through the chat template (as genai)
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in prompt or output

    def __post_init__(self) -> None:
        for name in ("do_sample", "ignore_eos", "apply_chat_template"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("max_new_tokens", "top_k"):
            self._check_int(name)
        for name in ("rng_seed", "eos_token_id"):
            if getattr(self, name) is not None:
                self._check_int(name)
        for name in ("temperature", "top_p", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(
                value, (int, float, np.number)
            ):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.do_sample and self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        stops = {self.stop_strings} if isinstance(self.stop_strings, str) else self.stop_strings
        try:
            stops = set(stops)
        except TypeError:
            raise ValueError(f"stop_strings must be a set of strings, got {stops!r}") from None
        if not all(isinstance(stop, str) and stop for stop in stops):
            raise ValueError(
                f"stop_strings must be non-empty strings, got {sorted(map(repr, stops))}"
            )
        self.stop_strings = stops

    def _check_int(self, name: str) -> None:
        value = getattr(self, name)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        setattr(self, name, int(value))

    @classmethod
    def build(cls, base: GenerationConfig | None = None, **kwargs: Any) -> GenerationConfig:
        """``base`` updated with ``kwargs``; unknown names are errors."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown generation setting(s) {unknown}; known: {sorted(known)}")
        values = {f.name: getattr(base, f.name) for f in fields(cls)} if base else {}
        values.update(kwargs)
        return cls(**values)


class Sampler:
    """Chooses tokens; holds the random generator so a seed makes a run repeatable."""

    def __init__(self, config: GenerationConfig, prompt: np.ndarray | None = None) -> None:
        self.config = config
        self.rng = np.random.default_rng(config.rng_seed)
        self.seen: set[int] = set() if prompt is None else {int(t) for t in prompt}

    def _penalize(self, logits: np.ndarray) -> np.ndarray:
        """CTRL-style penalty (as in transformers / genai): positive logits of tokens seen so
        far are divided by the penalty, negative ones multiplied."""
        idx = np.fromiter(self.seen, np.int64, len(self.seen))
        idx = idx[(idx >= 0) & (idx < logits.size)]
        out = logits.astype(np.float32, copy=True)
        seen = out[idx]
        out[idx] = np.where(
            seen > 0, seen / self.config.repetition_penalty, seen * self.config.repetition_penalty
        )
        return out

    def __call__(self, logits: np.ndarray) -> int:
        cfg = self.config
        if cfg.repetition_penalty != 1.0 and self.seen:
            logits = self._penalize(logits)
        token = self._choose(logits)
        self.seen.add(token)
        return token

    def _choose(self, logits: np.ndarray) -> int:
        cfg = self.config
        if not cfg.do_sample:
            return int(np.argmax(logits))
        scores = logits.astype(np.float64) / cfg.temperature
        if cfg.top_k and cfg.top_k < scores.size:
            # exactly k tokens; among equal scores the lowest id wins, as in argmax, so top_k=1
            # is greedy even when bf16 logits tie
            kth = np.partition(scores, -cfg.top_k)[-cfg.top_k]
            above = np.flatnonzero(scores > kth)
            keep = np.concatenate([above, np.flatnonzero(scores == kth)[: cfg.top_k - above.size]])
            kept = np.full_like(scores, -np.inf)
            kept[keep] = scores[keep]
            scores = kept
        probs = np.exp(scores - scores.max())
        probs /= probs.sum()
        if cfg.top_p < 1.0:
            order = np.argsort(-probs)
            cumulative = np.cumsum(probs[order])
            keep = order[: int(np.searchsorted(cumulative, cfg.top_p)) + 1]
            mask = np.zeros_like(probs)
            mask[keep] = probs[keep]
            probs = mask / mask.sum()
        return int(self.rng.choice(probs.size, p=probs))
