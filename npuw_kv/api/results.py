"""What :meth:`~npuw_kv.pipeline.LLMPipeline.generate` returns, shaped like openvino-genai's.

* a text prompt: :class:`TextResult`, a ``str`` (the answer, as genai returns a plain
  ``str``) that also carries our :class:`~npuw_kv.generation.decode.GenerationResult`'s fields and
  ``perf_metrics``;
* a list of prompts, a ``ChatHistory`` or a list of messages (and a text prompt with
  ``num_return_sequences`` > 1): :class:`DecodedResults`;
* ``ov.Tensor`` / ``TokenizedInputs`` token ids: :class:`EncodedResults`.

Their ``perf_metrics`` are :class:`~npuw_kv.api.perf_metrics.PerfMetrics`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

import numpy as np
import openvino_genai

from .generation_result import GenerationResult
from .perf_metrics import PerfMetrics

FinishReason = openvino_genai.GenerationFinishReason
# genai reports a streamer's CANCEL as NONE, its STOP as STOP
_FINISH = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "cancelled": FinishReason.NONE,
    "tool_call": FinishReason.TOOL_CALL,
}


def finish_reason(reason: str) -> Any:
    """Our finish reason ("stop" / "length" / "cancelled") as genai's enum."""
    return _FINISH[reason]


class TextResult(str):
    """The answer to a text prompt: a ``str`` like openvino-genai's, carrying our result's
    fields too (``tokens``, ``finish_reason``, ``prompt_tokens``, ``ttft_s``, ``decode_s``,
    ``ms_per_token``, ``first_logits``, ``text``) and ``perf_metrics``."""

    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    ttft_s: float
    decode_s: float
    first_logits: np.ndarray | None
    perf_metrics: PerfMetrics

    @classmethod
    def of(cls, result: GenerationResult, perf_metrics: PerfMetrics) -> TextResult:
        text = cls(result.text)
        for f in fields(result):  # every field of ours (logprobs, score, ... as they come)
            if f.name != "text":
                setattr(text, f.name, getattr(result, f.name))
        text.perf_metrics = perf_metrics
        return text

    @property
    def text(self) -> str:
        return str(self)

    @property
    def ms_per_token(self) -> float:
        return 1000.0 * self.decode_s / max(len(self.tokens) - 1, 1)


def _field(name: str) -> Any:
    """A plain read-write attribute over genai's read-only property of the same name (its
    C++ fields stay empty: ours are what Python code reads)."""
    key = f"_{name}"
    return property(
        lambda self: self.__dict__[key], lambda self, value: self.__dict__.__setitem__(key, value)
    )


class _Results:
    """What genai's ``DecodedResults`` and ``EncodedResults`` share: ``scores``,
    ``finish_reasons``, ``perf_metrics``, ``extended_perf_metrics`` (speculative decoding's
    per-model metrics, else None, as genai) and ``results``, our per-sequence results.  The
    classes derive from genai's, so ``isinstance`` checks written for genai hold."""

    scores = _field("scores")
    finish_reasons = _field("finish_reasons")
    perf_metrics = _field("perf_metrics")
    extended_perf_metrics = _field("extended_perf_metrics")

    def __init__(
        self,
        results: Sequence[GenerationResult],
        perf_metrics: PerfMetrics,
        extended_perf_metrics: PerfMetrics | None = None,
    ) -> None:
        if isinstance(self, openvino_genai.DecodedResults):
            super().__init__()  # genai's base (a pybind11 class) must be initialised
        self.results = list(results)
        self.scores = [float(getattr(r, "score", 0.0)) for r in results]
        self.finish_reasons = [finish_reason(r.finish_reason) for r in results]
        self.perf_metrics = perf_metrics
        self.extended_perf_metrics = extended_perf_metrics
        self._outputs(self.results)

    def _outputs(self, results: list[GenerationResult]) -> None:
        """Set the outputs of this kind (texts or tokens)."""


class DecodedResults(_Results, openvino_genai.DecodedResults):
    """Texts, as openvino-genai's ``DecodedResults``: ``num_return_sequences`` entries per
    prompt, in prompt order."""

    texts = _field("texts")
    parsed = _field("parsed")

    def _outputs(self, results: list[GenerationResult]) -> None:
        self.texts = [r.text for r in results]
        self.parsed = []

    def __str__(self) -> str:  # genai's: the text alone, or "score: text" lines
        if len(self.texts) == 1:
            return self.texts[0]
        return "\n".join(f"{s:.6f}: {t}" for s, t in zip(self.scores, self.texts, strict=True))

    def __repr__(self) -> str:
        return f"DecodedResults(texts={self.texts!r})"


class EncodedResults(_Results):
    """Token ids, as openvino-genai's ``EncodedResults``: ``tokens`` is one list per sequence,
    ending with the stop token when one ended it, as genai's do (genai's class has no Python
    constructor, so this one cannot derive from it)."""

    def _outputs(self, results: list[GenerationResult]) -> None:
        self.tokens = [r.genai_tokens for r in results]

    def __repr__(self) -> str:
        return f"EncodedResults(tokens={self.tokens!r})"


def shape_results(
    kind: str,
    results: list[GenerationResult],
    metrics: PerfMetrics,
    extended: Any,
    parsing: Any = None,
) -> TextResult | DecodedResults | EncodedResults | GenerationResult:
    """What genai returns for a request of ``kind`` (``api.inputs``): token ids give our
    result, tensors ``EncodedResults``, one text a ``TextResult``, the rest
    ``DecodedResults`` (with a ``TextParserStreamer``'s parsed message)."""
    if kind == "ids":
        return results[0]
    if kind == "encoded":
        return EncodedResults(results, metrics, extended)
    if kind == "text" and len(results) == 1:
        return TextResult.of(results[0], metrics)
    decoded = DecodedResults(results, metrics, extended)
    if parsing is not None:  # as genai: the message its parsers built from the answer
        decoded.parsed = [parsing.get_parsed_message()]
    return decoded
