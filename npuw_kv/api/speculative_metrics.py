"""Speculative decoding's ``extended_perf_metrics``, shaped like openvino-genai's.

genai returns an ``SDPerModelsPerfMetrics`` there: the call's own metrics (its ``PerfMetrics``
getters) plus ``main_model_metrics`` and ``draft_model_metrics`` (``SDPerfMetrics``) and the
candidate counts.  An ``SDPerfMetrics`` is one model's calls, as genai counts them: per call
its duration (``m_durations``), end time and the answer tokens taken from it
(``m_batch_sizes``: for the main model 1 + the candidates of that call the sampler accepted,
for the draft 1 per call that picked a candidate, 0 for its prompt); ``get_ttst`` is the
second call, ``get_latency`` the calls from the third on, ``get_tpot`` those calls' durations
per token they gave (genai's formulas, checked against its own numbers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .perf_metrics import MeanStdPair, PerfMetrics, RawPerfMetrics, mean_std, now_us


@dataclass
class ModelCalls:
    """One model's calls for one prompt: duration (µs), end time and tokens given, each."""

    durations: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def run(self, call: Callable[..., Any], *args: Any, tokens: int = 1) -> Any:
        """``call(*args)``, timed; ``tokens``: answer tokens taken from its output so far."""
        start = now_us()
        out = call(*args)
        end = now_us()
        self.durations.append(end - start)
        self.ends.append(end)
        self.tokens.append(tokens)
        return out

    def took_another(self) -> None:
        """One more answer token was taken from the last call's output."""
        self.tokens[-1] += 1


class SDPerfMetrics(PerfMetrics):
    """One model's calls in speculative decoding (genai's ``SDPerfMetrics``): every
    ``PerfMetrics`` getter, plus ``get_ttst`` and ``get_latency``; ``segments`` holds how many
    calls each prompt made (a batch's prompts run one after another)."""

    segments: tuple[int, ...] = ()

    @classmethod
    def _of(cls, base: PerfMetrics, segments: Sequence[int]) -> SDPerfMetrics:
        out = cls(
            base.raw_metrics, base.load_time, base.num_generated_tokens, base.num_input_tokens
        )
        out.segments = tuple(segments)  # calls per prompt
        return out

    @classmethod
    def of(cls, prompts: Sequence[ModelCalls], load_time: float, inputs: int) -> SDPerfMetrics:
        raw = RawPerfMetrics()
        for calls in prompts:
            raw.m_durations += calls.durations
            raw.token_infer_durations += calls.durations
            raw.m_new_token_times += calls.ends
            raw.m_batch_sizes += calls.tokens
            raw.m_times_to_first_token += calls.durations[:1]
        total = float(sum(raw.m_durations))
        raw.inference_durations.append(total)
        raw.generate_durations.append(total)  # genai's getter: the sum of the calls
        generated = sum(sum(calls.tokens) for calls in prompts)
        base = PerfMetrics(raw, load_time, generated, inputs)
        return cls._of(base, [len(calls.durations) for calls in prompts])

    def _per_prompt(self, first: int, per_token: bool = False) -> list[float]:
        """Each prompt's call durations from its ``first``-th call on (per token given)."""
        raw, out, at = self.raw_metrics, list[float](), 0
        for n in self.segments:
            for i in range(at + first, at + n):
                tokens = raw.m_batch_sizes[i]
                if not per_token:
                    out.append(raw.m_durations[i])
                elif tokens:  # a call that gave no token (the draft's prompt) has no TPOT
                    out.append(raw.m_durations[i] / tokens)
            at += n
        return out

    def get_ttst(self) -> MeanStdPair:
        """Each prompt's second call (genai: the second token's time, shown apart)."""
        raw, out, at = self.raw_metrics, list[float](), 0
        for n in self.segments:
            if n > 1:
                out.append(raw.m_durations[at + 1])
            at += n
        return mean_std(out)

    def get_latency(self) -> MeanStdPair:
        """Mean time of a call from the third on (ms per inference)."""
        return mean_std(self._per_prompt(2))

    def get_tpot(self) -> MeanStdPair:
        """From the third call on, each call's duration per answer token it gave."""
        return mean_std(self._per_prompt(2, per_token=True))

    def __add__(self, other: PerfMetrics) -> SDPerfMetrics:
        if not isinstance(other, SDPerfMetrics):
            return NotImplemented
        return self._of(self._sum(other), self.segments + other.segments)


class SDPerModelsPerfMetrics(PerfMetrics):
    """genai's ``SDPerModelsPerfMetrics``: the call's metrics (the ``PerfMetrics`` getters),
    ``main_model_metrics``, ``draft_model_metrics`` and the candidates' counts."""

    def __init__(
        self,
        overall: PerfMetrics,
        main: SDPerfMetrics,
        draft: SDPerfMetrics,
        accepted: int,
        candidates: int,
    ) -> None:
        super().__init__(
            overall.raw_metrics,
            overall.load_time,
            overall.num_generated_tokens,
            overall.num_input_tokens,
        )
        self.main_model_metrics = main
        self.draft_model_metrics = draft
        self.num_accepted_tokens = accepted
        self.num_draft_tokens = candidates

    def get_ttst(self) -> MeanStdPair:  # genai's: the per-model values are in *_model_metrics
        return MeanStdPair(0.0, 0.0)

    get_latency = get_ttst

    def get_num_accepted_tokens(self) -> int:
        """Candidates the main model accepted (the sampler chose them)."""
        return self.num_accepted_tokens

    def get_num_draft_tokens(self) -> int:
        """Candidates offered to the main model."""
        return self.num_draft_tokens

    def get_num_rejected_tokens(self) -> int:
        return self.num_draft_tokens - self.num_accepted_tokens

    def get_num_draft_processed_tokens(self) -> int:
        """Tokens the draft model picked (a candidate it dropped below the confidence
        threshold included)."""
        return self.draft_model_metrics.num_generated_tokens

    def get_draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def get_draft_processed_to_candidate_ratio(self) -> float:
        processed = self.get_num_draft_processed_tokens()
        return processed / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def get_draft_to_main_inference_duration_ratio(self) -> float:
        main = self.main_model_metrics.get_inference_duration().mean
        draft = self.draft_model_metrics.get_inference_duration().mean
        return draft / main if main > 0 else 0.0

    def __add__(self, other: PerfMetrics) -> SDPerModelsPerfMetrics:
        if not isinstance(other, SDPerModelsPerfMetrics):
            return NotImplemented
        return SDPerModelsPerfMetrics(
            self._sum(other),
            self.main_model_metrics + other.main_model_metrics,
            self.draft_model_metrics + other.draft_model_metrics,
            self.num_accepted_tokens + other.num_accepted_tokens,
            self.num_draft_tokens + other.num_draft_tokens,
        )
