"""Timing of generate calls, shaped like openvino-genai's ``PerfMetrics``.

:class:`PerfMetrics` has genai's getters and units: durations in ms, throughput in tokens/s,
the raw lists (:class:`RawPerfMetrics`) in microseconds.  :class:`CallTimer` measures one call;
:class:`TimedRunner` times each runner call of it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any, cast

import numpy as np

from ..errors import UsageError
from ..runtime.runner import Runner
from .generation_result import GenerationResult


@dataclass(frozen=True)
class MeanStdPair:
    mean: float
    std: float

    def __iter__(self) -> Iterator[float]:
        yield self.mean
        yield self.std


@dataclass
class SummaryStats:
    """genai's ``SummaryStats``: mean, std, min and max in ms (-1 each when empty)."""

    mean: float
    std: float
    min: float
    max: float


def summary(values_us: Sequence[float]) -> SummaryStats:
    """Mean, (population) std, min and max in ms of microsecond values; -1 each when empty,
    as genai."""
    if not values_us:
        return SummaryStats(-1.0, -1.0, -1.0, -1.0)
    values = np.asarray(values_us, np.float64) / 1000.0
    return SummaryStats(
        float(values.mean()), float(values.std()), float(values.min()), float(values.max())
    )


def mean_std(values_us: Sequence[float]) -> MeanStdPair:
    """:func:`summary`'s mean and std."""
    stats = summary(values_us)
    return MeanStdPair(stats.mean, stats.std)


@dataclass
class RawPerfMetrics:
    """genai's raw lists, in microseconds.  One entry per generate call: generate and
    inference durations; per prompt (they run one after another): tokenization, chat template,
    detokenization, time to first token; per runner call: ``token_infer_durations`` and
    ``m_new_token_times`` (timestamps); per decode step: ``m_durations``."""

    generate_durations: list[float] = field(default_factory=list)
    tokenization_durations: list[float] = field(default_factory=list)
    detokenization_durations: list[float] = field(default_factory=list)
    chat_template_durations: list[float] = field(default_factory=list)
    m_times_to_first_token: list[float] = field(default_factory=list)
    m_new_token_times: list[float] = field(default_factory=list)
    token_infer_durations: list[float] = field(default_factory=list)
    m_batch_sizes: list[int] = field(default_factory=list)
    m_durations: list[float] = field(default_factory=list)
    inference_durations: list[float] = field(default_factory=list)
    grammar_compile_times: list[float] = field(default_factory=list)  # one per constraint
    sampling_durations: list[float] = field(default_factory=list)  # not measured: empty

    def __add__(self, other: RawPerfMetrics) -> RawPerfMetrics:
        return RawPerfMetrics(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        )


class PerfMetrics:
    """Timings of generate calls, with openvino-genai's getters; ``a + b`` / ``a += b``
    combine calls of one pipeline (means over the combined raw values, counts summed)."""

    def __init__(
        self,
        raw_metrics: RawPerfMetrics | None = None,
        load_time: float = 0.0,
        num_generated_tokens: int = 0,
        num_input_tokens: int = 0,
        grammar_compiler_init_times: dict[str, float] | None = None,
    ) -> None:
        self.raw_metrics = raw_metrics or RawPerfMetrics()
        self.load_time = load_time  # ms
        self.num_generated_tokens = num_generated_tokens
        self.num_input_tokens = num_input_tokens
        # µs each grammar backend took to set up for the tokenizer (calls with structured output)
        self.grammar_compiler_init_times = dict(grammar_compiler_init_times or {})

    def get_load_time(self) -> float:
        return self.load_time

    def get_num_generated_tokens(self) -> int:
        return self.num_generated_tokens

    def get_num_input_tokens(self) -> int:
        return self.num_input_tokens

    def get_ttft(self) -> MeanStdPair:
        return mean_std(self.raw_metrics.m_times_to_first_token)

    def get_tpot(self) -> MeanStdPair:
        return mean_std(self.raw_metrics.m_durations)

    def get_ipot(self) -> MeanStdPair:
        return mean_std(self.raw_metrics.token_infer_durations)

    def get_throughput(self) -> MeanStdPair:
        """Tokens per second, from TPOT as genai computes it (-1000 when TPOT is unset)."""
        tpot = self.get_tpot()
        if tpot.mean == 0:
            return MeanStdPair(-1.0, -1.0)
        return MeanStdPair(1000.0 / tpot.mean, tpot.std * 1000.0 / tpot.mean**2)

    def get_generate_duration(self) -> MeanStdPair:
        return mean_std(self.raw_metrics.generate_durations)

    def get_inference_duration(self) -> MeanStdPair:
        return mean_std(self.raw_metrics.inference_durations)

    def get_tokenization_duration(self) -> MeanStdPair:
        return mean_std(self.raw_metrics.tokenization_durations)

    def get_detokenization_duration(self) -> MeanStdPair:
        return mean_std(self.raw_metrics.detokenization_durations)

    def get_chat_template_duration(self) -> MeanStdPair:
        return mean_std(self.raw_metrics.chat_template_durations)

    def get_sampling_duration(self) -> MeanStdPair:
        return mean_std(self.raw_metrics.sampling_durations)

    def get_grammar_compiler_init_times(self) -> dict[str, float]:
        return dict(self.grammar_compiler_init_times)

    def get_grammar_compile_time(self) -> SummaryStats:
        """Each structured-output constraint's grammar compile time (a cached grammar takes a
        lookup), in ms."""
        return summary(self.raw_metrics.grammar_compile_times)

    def _sum(self, other: PerfMetrics) -> PerfMetrics:
        """The combined calls, as a plain :class:`PerfMetrics` (subclasses add their parts)."""
        if other.load_time != self.load_time:  # genai's check: one pipeline's calls only
            raise UsageError("generation metrics can be accumulated only for the same pipeline")
        return PerfMetrics(
            self.raw_metrics + other.raw_metrics,
            self.load_time,
            self.num_generated_tokens + other.num_generated_tokens,
            self.num_input_tokens + other.num_input_tokens,
            {**self.grammar_compiler_init_times, **other.grammar_compiler_init_times},
        )

    def __add__(self, other: PerfMetrics) -> PerfMetrics:
        if not isinstance(other, PerfMetrics):
            return NotImplemented
        return self._sum(other)

    def __iadd__(self, other: PerfMetrics) -> PerfMetrics:
        combined = self + other
        if combined is NotImplemented:
            return NotImplemented
        vars(self).update(vars(combined))  # every field, a subclass's too
        return self

    def __repr__(self) -> str:
        return (
            f"PerfMetrics(ttft={self.get_ttft().mean:.1f} ms, tpot={self.get_tpot().mean:.1f} "
            f"ms, generated={self.num_generated_tokens}, input={self.num_input_tokens})"
        )


def now_us() -> float:
    return time.perf_counter() * 1e6


class TimedRunner:
    """A runner whose prefill/step calls are timed into a :class:`CallTimer`; each prefill
    starts a sequence: ``sequences`` holds (its first call's start, each call's end).
    Beam search times its steps through :meth:`call` and sets ``beam_steps``: genai counts one
    generated token per beam-search step, whatever the number of beams or results."""

    def __init__(self, runner: Runner, timer: CallTimer) -> None:
        self._runner, self._timer = runner, timer
        self.sequences: list[tuple[float, list[float]]] = []
        self.beam_steps = False

    def call(self, run: Any, *args: Any) -> np.ndarray:
        """``run(*args)``, timed as one model call (a decode step) of the current sequence."""
        start = now_us()
        logits = run(*args)
        end = now_us()
        self.sequences[-1][1].append(end)
        raw = self._timer.raw
        raw.token_infer_durations.append(end - start)
        raw.m_new_token_times.append(end)
        raw.m_batch_sizes.append(1)
        return cast(np.ndarray, logits)

    def prefill(self, ids: np.ndarray, *args: Any) -> np.ndarray:
        self.sequences.append((now_us(), []))
        return self.call(self._runner.prefill, ids, *args)

    def prefill_every_row(self, ids: np.ndarray, on_rows: Any) -> np.ndarray:
        self.sequences.append((now_us(), []))
        return self.call(self._runner.prefill_every_row, ids, on_rows)

    def step(self, token: int) -> np.ndarray:
        return self.call(self._runner.step, token)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)


class CallTimer:
    """Collects one generate call's timings into :class:`PerfMetrics`."""

    def __init__(self, load_time: float) -> None:
        self.load_time = load_time
        self.start = now_us()
        self.raw = RawPerfMetrics()
        self.generated = self.inputs = 0
        self.grammar_init: dict[str, float] = {}  # µs, by grammar backend

    now = staticmethod(now_us)

    @contextmanager
    def span(self, key: str) -> Iterator[None]:
        """Time the block into the raw list ``key`` (e.g. ``tokenization_durations``)."""
        start = now_us()
        try:
            yield
        finally:
            getattr(self.raw, key).append(now_us() - start)

    def runner(self, runner: Runner) -> Runner:
        """``runner`` with its calls timed, for the sequences of one prompt."""
        return cast(Runner, TimedRunner(runner, self))

    def prompt_done(
        self, timed: Runner, started: float, results: Sequence[GenerationResult], tokenizer: Any
    ) -> None:
        """Account the sequences ``timed`` (:meth:`runner`'s) ran for one prompt that began at
        ``started`` (µs, before its tokenization: its first answer's time to first token
        counts from there); a ``tokenizer`` times the detokenization of each answer (None:
        token ids out, nothing to detokenize)."""
        beams = cast(TimedRunner, timed).beam_steps
        sequences = cast(TimedRunner, timed).sequences
        if beams:  # a token per step (all its beams'), the prefill's included, as genai
            self.generated += sum(len(ends) for _, ends in sequences)
        for i, result in enumerate(results):
            # beam search prefills once for all its results: those after the first have none
            if i < len(sequences):
                first, ends = sequences[i]
                begin = started if i == 0 else first
                self.raw.m_times_to_first_token.append(first - begin + 1e6 * result.ttft_s)
                self.raw.m_durations.extend(np.diff(ends).tolist())
            if tokenizer is not None:
                with self.span("detokenization_durations"):
                    tokenizer.decode(result.tokens)
            if not beams:
                self.generated += _generated(result)

    def batch_done(
        self, times: Any, requests: Sequence[Sequence[GenerationResult]], tokenizer: Any
    ) -> None:
        """Account a call's requests run in a batch (:mod:`npuw_kv.generation.session`), each
        a sequence's result or a beam search's results: each step they ran in once, however
        many sequences it ran; each request's time to first token from its submission (it
        may have waited for room); beam search's generated tokens as genai counts them, one
        per step (all its beams')."""
        raw = self.raw
        raw.token_infer_durations.extend(times.durations)
        raw.m_new_token_times.extend(times.ends)
        raw.m_batch_sizes.extend(times.sizes)
        raw.m_durations.extend(np.diff(times.ends).tolist())
        for results in requests:
            if results:
                raw.m_times_to_first_token.append(1e6 * results[0].ttft_s)
            for result in results:
                if tokenizer is not None:
                    with self.span("detokenization_durations"):
                        tokenizer.decode(result.tokens)
                if not times.beam_steps:
                    self.generated += _generated(result)
        self.generated += times.beam_steps

    def metrics(self) -> PerfMetrics:
        self.raw.generate_durations.append(now_us() - self.start)
        self.raw.inference_durations.append(float(sum(self.raw.token_infer_durations)))
        return PerfMetrics(self.raw, self.load_time, self.generated, self.inputs, self.grammar_init)


def _generated(result: GenerationResult) -> int:
    """A sequence's generated tokens as genai counts them: the stop token that ended it too."""
    return len(result.tokens) + (result.stop_token is not None)
