"""Next-token selection from one logits row: greedy, or top-k / temperature / min-p / top-p
sampling, after :mod:`~npuw_kv.generation.logits_process`'s penalties and masks.

Each choice carries its log-probability as openvino-genai scores it: with ``logprobs`` > 0 the
raw model distribution's (before penalties and filters), else the sampled distribution's, and
0 for greedy decoding (genai computes none there).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..api.generation_config import GenerationConfig
from ..errors import NumericError
from .logits_process import LogitsConstraint, LogitsProcessor, log_softmax


@dataclass
class Choice:
    token: int
    logprob: float
    # (token, raw log-prob) of the ``config.logprobs`` most likely tokens, best first
    top: list[tuple[int, float]] = field(default_factory=list)


class Sampler:
    """Chooses the tokens of one sequence; ``rng`` may be shared so that sequences sampled one
    after another differ while a seed still makes the whole run repeatable."""

    def __init__(
        self,
        config: GenerationConfig,
        prompt: np.ndarray | None = None,
        rng: np.random.Generator | None = None,
    ) -> None:
        self.config = config
        self.rng = rng if rng is not None else np.random.default_rng(config.rng_seed)
        self.process = LogitsProcessor(config, prompt)

    def __call__(self, logits: np.ndarray) -> int:
        return self.sample(logits).token

    def sample(self, logits: np.ndarray, constraint: LogitsConstraint | None = None) -> Choice:
        """Choose the next token and remember it (penalties count it from now on)."""
        cfg = self.config
        # NaN or +inf: an overflow in the model (a model's own -inf masks a token, as ours do)
        if np.isnan(logits).any() or (logits == np.inf).any():
            raise NumericError()
        scores = self.process(logits, constraint)
        if not (scores > -np.inf).any():
            raise RuntimeError(
                "no token is allowed next: the stop-token mask (min_new_tokens), "
                "no_repeat_ngram_size or the structured-output constraint excluded them all"
            )
        raw = log_softmax(logits) if cfg.logprobs else None
        if cfg.do_sample:
            probs = self._distribution(scores)
            token = int(self.rng.choice(probs.size, p=probs))
            logprob = float(np.log(probs[token]))
        else:
            token, logprob = int(np.argmax(scores)), 0.0
        top: list[tuple[int, float]] = []
        if raw is not None:
            logprob = float(raw[token])
            n = min(cfg.logprobs, raw.size)
            best = np.argpartition(-raw, n - 1)[:n]
            best = best[np.argsort(-raw[best], kind="stable")]
            top = [(int(t), float(raw[t])) for t in best]
        self.process.accept(token)
        return Choice(token, logprob, top)

    def _distribution(self, logits: np.ndarray) -> np.ndarray:
        """Sampling probabilities, in genai's order: top-k, temperature, min-p, top-p (top-p
        counts the mass min-p left, not renormalized, as genai does)."""
        cfg = self.config
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
        if cfg.min_p > 0:
            probs = np.where(probs >= cfg.min_p * probs.max(), probs, 0.0)
        if cfg.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cumulative = np.cumsum(probs[order])
            keep = order[: int(np.searchsorted(cumulative, cfg.top_p, side="right")) + 1]
            mask = np.zeros_like(probs)
            mask[keep] = probs[keep]
            probs = mask
        return probs / probs.sum()
