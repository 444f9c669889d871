"""``ContinuousBatchingPipeline``: openvino-genai's request-level API over npuw-kv's engine.

Requests are added at any time (:meth:`ContinuousBatchingPipeline.add_request`) and each
:meth:`~ContinuousBatchingPipeline.step` runs one batched model call over every live sequence
(:class:`~npuw_kv.runtime.paged.scheduler.Scheduler`): new requests join between steps, finished
ones leave.  A request's :class:`GenerationHandle` reads its tokens as they come.  It runs on
the CPU path (PagedAttention) only; beam searches join the batch too.  With a draft model or
prompt lookup, each request runs alone in its steps, one after another
(:mod:`~npuw_kv.generation.assisted_lane`).  Like ``LLMPipeline`` it is a face over an
:class:`~npuw_kv.engine.Engine`.
"""

from __future__ import annotations

import itertools
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import openvino as ov
import openvino_genai

from .api.generation_config import GenerationConfig
from .api.generation_result import GenerationResult
from .api.results import finish_reason
from .engine import Engine
from .errors import NumericError, UsageError
from .generation.beam_search import check_beam_request
from .generation.pipeline_metrics import MetricsRecorder, PipelineMetrics
from .generation.running_batch import SequenceRequest, Ticket
from .runtime.paged.runner import PagedRunner

Status = openvino_genai.GenerationStatus


@dataclass
class GenerationOutput:
    """One sequence's tokens so far, shaped like genai's ``GenerationOutput``."""

    generated_ids: list[int] = field(default_factory=list)
    generated_log_probs: list[float] = field(default_factory=list)
    score: float = 0.0
    finish_reason: Any = openvino_genai.GenerationFinishReason.NONE


@dataclass
class _Sequence:
    engine_handle: int
    output: GenerationOutput = field(default_factory=GenerationOutput)
    result: GenerationResult | None = None
    read_upto: int = 0


def _output(result: GenerationResult) -> GenerationOutput:
    reason = finish_reason(result.finish_reason)
    # as genai's, the ids end with the stop token that ended the answer
    return GenerationOutput(result.genai_tokens, list(result.logprobs), result.score, reason)


class GenerationHandle:
    """What :meth:`ContinuousBatchingPipeline.add_request` returns: the request's sequences
    (``num_return_sequences`` of them), read as they grow.  A sequence that failed (a
    sampling setting the logits could not take) raises its error from the reads.

    Any thread may read it while another steps the pipeline: its sequences change under a lock
    of its own, which is never held while waiting for the batch (the stepping thread takes
    it to hand over each token)."""

    def __init__(
        self,
        request_id: int,
        end: Callable[[GenerationHandle, Any], None],
        explain: Callable[[BaseException], BaseException] = lambda exc: exc,
    ) -> None:
        """``end(handle, status)``: stop or cancel the request in its pipeline;
        ``explain(error)``: the error a failed sequence raises (named by its pipeline)."""
        self.request_id = request_id
        self._end = end
        self._explain = explain
        self.sequences: list[_Sequence] = []
        self.status = Status.RUNNING
        self.ticket = Ticket(on_token=self._on_token)
        self.lock = threading.RLock()

    def _on_token(self, engine_handle: int, token: int) -> None:
        with self.lock:
            for seq in self.sequences:
                if seq.engine_handle == engine_handle:
                    seq.output.generated_ids.append(token)

    def _sync(self) -> None:
        """Take the outcomes of the sequences that finished in the steps since (a beam
        search's several results become as many sequences)."""
        with self.lock:
            failed = self._take_outcomes()
        if failed is not None:
            self._end(self, Status.IGNORED)
            raise self._explain(failed)

    def _take_outcomes(self) -> BaseException | None:
        if self.status != Status.RUNNING:
            return None
        seqs: list[_Sequence] = []
        for seq in self.sequences:
            outcome = self.ticket.outcomes.get(seq.engine_handle)
            if outcome is None or seq.result is not None:
                seqs.append(seq)
                continue
            if isinstance(outcome, BaseException):
                return outcome
            for result in outcome if isinstance(outcome, list) else [outcome]:
                seqs.append(_Sequence(seq.engine_handle, _output(result), result, seq.read_upto))
        self.sequences = seqs
        if all(s.result is not None for s in self.sequences):
            # as genai: a request the KV pools could not hold ends IGNORED, with its outputs
            cut = any(s.result is not None and s.result.out_of_room for s in self.sequences)
            self.status = Status.IGNORED if cut else Status.FINISHED
        return None

    def get_status(self) -> Any:
        self._sync()
        return self.status

    def can_read(self) -> bool:
        """True when some sequence has tokens not read yet."""
        self._sync()
        with self.lock:
            return any(len(s.output.generated_ids) > s.read_upto for s in self.sequences)

    def read(self) -> dict[int, GenerationOutput]:
        """Each sequence's tokens since the last read, by sequence index."""
        self._sync()
        out = {}
        with self.lock:
            for i, seq in enumerate(self.sequences):
                new = seq.output.generated_ids[seq.read_upto :]
                if new:
                    logprobs = seq.output.generated_log_probs[seq.read_upto :]
                    out[i] = GenerationOutput(
                        new, logprobs, seq.output.score, seq.output.finish_reason
                    )
                    seq.read_upto = len(seq.output.generated_ids)
        return out

    def read_all(self) -> list[GenerationOutput]:
        """Every sequence's whole output (complete once the status is not RUNNING)."""
        self._sync()
        with self.lock:
            return [s.output for s in self.sequences]

    def stop(self) -> None:
        """End the request now, keeping what it generated (status STOP)."""
        self._end(self, Status.STOP)

    def cancel(self) -> None:
        """End the request now and drop what it generated (status CANCEL)."""
        self._end(self, Status.CANCEL)


@dataclass
class BatchGenerationResult:
    """One request's answers, shaped like genai's ``GenerationResult``: texts (or token lists
    for tokenized prompts) and scores."""

    m_request_id: int
    m_generation_ids: list[Any]
    m_scores: list[float]
    m_status: Any
    results: list[GenerationResult] = field(repr=False, default_factory=list)

    def get_generation_ids(self) -> list[Any]:
        return self.m_generation_ids


class ContinuousBatchingPipeline:
    """genai's ``ContinuousBatchingPipeline(models_path, scheduler_config, device, properties)``
    over an :class:`~npuw_kv.engine.Engine` on the CPU path."""

    def __init__(
        self,
        models_path: str | os.PathLike[str] | None,
        scheduler_config: Any = None,
        device: str = "CPU",
        properties: dict[str, Any] | None = None,
        tokenizer_properties: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """``properties`` may name a ``draft_model`` or ``prompt_lookup=True`` (assisted
        generation); ``tokenizer_properties`` compile the tokenizer's IRs, as genai's."""
        settings = {**(properties or {}), **kwargs}
        if scheduler_config is not None:
            settings["scheduler_config"] = scheduler_config
        elif str(device).upper() == "CPU" and not any(
            str(k).upper() == "ATTENTION_BACKEND" for k in settings
        ):  # genai's continuous batching always pages its KV (as under a SchedulerConfig)
            settings["attention_backend"] = "pa"
        self.engine = Engine(models_path, (device,), settings, tokenizer_properties)
        runner = self.engine.runner
        if self.engine.batch is None:
            raise UsageError(
                "ContinuousBatchingPipeline runs where sequences run together: the paged path "
                "(device CPU, attention_backend 'pa') or the NPU path with max_num_seqs > 1; "
                "the CPU's static-shape path runs one sequence at a time"
            )
        self.runner = runner
        # the engine's running batch: the calls of an LLMPipeline over the same engine
        # (LLMPipeline(engine)) join it too
        self.batch = self.engine.batch
        self._request_ids = itertools.count(1 << 40)  # generate()'s own requests
        self._metrics = MetricsRecorder()
        self._history: list[dict[str, str]] | None = None  # start_chat's conversation

    # -- genai's accessors -----------------------------------------------------------------------
    def get_tokenizer(self) -> openvino_genai.Tokenizer:
        return self.engine.tokenizer

    def get_config(self) -> GenerationConfig:
        return GenerationConfig.build(self.engine.generation_config)

    def has_non_finished_requests(self) -> bool:
        return self.batch.busy

    def get_metrics(self) -> PipelineMetrics:
        """genai's ``PipelineMetrics`` after the last step
        (:mod:`~npuw_kv.generation.pipeline_metrics`)."""
        return self._metrics.snapshot()

    # -- chat (genai's start_chat / finish_chat, deprecated there too) -------------------------
    def start_chat(self, system_message: str = "") -> None:
        """``generate`` takes one prompt at a time from now on, as the next user turn of a
        conversation (the chat template over every turn so far)."""
        warnings.warn(
            "start_chat() / finish_chat() are deprecated in openvino_genai: pass a "
            "ChatHistory to LLMPipeline.generate instead",
            DeprecationWarning,
            stacklevel=2,
        )
        self._history = [{"role": "system", "content": system_message}] if system_message else []

    def finish_chat(self) -> None:
        """The conversation ends: ``generate`` takes independent prompts again."""
        warnings.warn(
            "start_chat() / finish_chat() are deprecated in openvino_genai: pass a "
            "ChatHistory to LLMPipeline.generate instead",
            DeprecationWarning,
            stacklevel=2,
        )
        self._history = None

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, request_id: int, prompt: Any, generation_config: Any) -> GenerationHandle:
        """Queue a request: ``prompt`` as text (through the chat template when the config's
        ``apply_chat_template`` is on and the model has one) or token ids (``ov.Tensor``)."""
        return self._add(request_id, prompt, generation_config, None)

    def _add(
        self,
        request_id: int,
        prompt: Any,
        generation_config: Any,
        history: list[dict[str, str]] | None,
    ) -> GenerationHandle:
        """:meth:`add_request`; a text prompt after ``history`` when given (a chat's turn)."""
        if isinstance(request_id, bool) or not isinstance(request_id, (int, np.integer)):
            raise UsageError(f"request_id must be an integer, got {request_id!r}")
        if not isinstance(prompt, (str, ov.Tensor)):
            raise UsageError(f"prompt must be a str or an ov.Tensor of token ids, got {prompt!r}")
        shape = list(prompt.get_shape()) if isinstance(prompt, ov.Tensor) else []
        if len(shape) == 2 and shape[0] != 1:
            raise UsageError(
                f"add_request takes one prompt: token ids of shape {shape} hold {shape[0]}; "
                "add each row as a request of its own"
            )
        engine = self.engine
        config, alphas, request = engine.admit(prompt, generation_config, {})
        (ask,) = request.prompts
        ids = ask.ids
        if ids is None:
            ids = engine.encoder.ids(ask, config.apply_chat_template, history)
        handle = GenerationHandle(int(request_id), self._end, self._explain)
        factory = engine.constraint(config)
        beams = config.num_beams > 1
        if beams:
            check_beam_request(config, None, factory)
        sequences = [
            SequenceRequest(ids, config, sample, factory() if factory is not None else None)
            for sample in range(1 if beams else config.num_return_sequences)
        ]
        # when the batch starts, its pools are sized for as many requests of this one's size
        # as may run at once
        self.batch.add(
            sequences,
            handle.ticket,
            at_once=self.batch.scheduler.max_num_seqs,
            mode=alphas,
        )
        handle.sequences = [_Sequence(h) for h in handle.ticket.handles]
        return handle

    def step(self) -> None:
        """One batched model call over every live sequence; their handles grow."""
        try:
            self.batch.step()
        except NumericError as exc:
            raise self._explain(exc) from exc
        loops, runner = self.batch.loops, self.runner
        if isinstance(runner, PagedRunner):
            windows = runner.blocks.stats().windows.values()
            usage = max((100.0 * w.primary_used / w.primary_total for w in windows), default=0.0)
            cache_bytes = runner.cache.bytes_allocated
        else:  # the NPU path's slots: how many hold a live sequence, and the pool
            report = self.batch.scheduler.stats.report()
            usage = 100.0 * self.batch.scheduler.slots_held / self.batch.scheduler.max_num_seqs
            cache_bytes = int(report.get("kv_pool_bytes", 0))
        self._metrics.step(
            requests=self.batch.requests,
            scheduled=loops.last_requests,
            usage=usage,
            duration_us=loops.last_duration_us,
            cache_bytes=cache_bytes,
        )

    def _explain(self, error: BaseException) -> BaseException:
        """A sequence's error as raised: NaN / +inf logits named with the settings that would
        remove them (none already set)."""
        if isinstance(error, NumericError):
            named = self.engine.numeric_error()
            named.__cause__ = error
            return named
        return error

    def _end(self, handle: GenerationHandle, status: Any) -> None:
        """Stop or cancel ``handle``'s request: its sequences leave the engine now."""
        if handle.status != Status.RUNNING:
            return
        self.batch.drop([s.engine_handle for s in handle.sequences if s.result is None])
        with handle.lock:
            if status == Status.CANCEL:
                for seq in handle.sequences:
                    seq.output = GenerationOutput()
            handle.status = status

    def generate(
        self, prompts: Sequence[Any], generation_config: Any, streamer: Any = None
    ) -> list[BatchGenerationResult]:
        """Every prompt with its own config (one config for all is taken too), run together;
        one result per prompt, in order."""
        if streamer is not None:
            raise UsageError("a streamer takes one answer: ContinuousBatchingPipeline.generate "
                             "runs many; read GenerationHandle.read() instead")  # fmt: skip
        if isinstance(prompts, str):
            prompts = [prompts]
        history = self._history
        if history is not None and (len(prompts) != 1 or not isinstance(prompts[0], str)):
            raise UsageError(
                "in a chat (start_chat) generate takes one text prompt, the next user turn; "
                f"got {len(prompts)} prompts"
            )
        configs = (
            list(generation_config)
            if isinstance(generation_config, (list, tuple))
            else [generation_config] * len(prompts)
        )
        if len(configs) != len(prompts):
            raise UsageError(
                f"{len(prompts)} prompts but {len(configs)} generation configs: give one per "
                "prompt, or one for all"
            )
        handles: list[GenerationHandle] = []
        try:
            for p, c in zip(prompts, configs, strict=True):
                handles.append(self._add(next(self._request_ids), p, c, history))
        except BaseException:
            for handle in handles:  # the call fails whole: the requests it added end too
                handle.cancel()
            raise
        self._metrics.reset_usage()
        while any(h.get_status() == Status.RUNNING for h in handles):
            self.step()
        out = []
        for handle, prompt in zip(handles, prompts, strict=True):
            results = [s.result for s in handle.sequences if s.result is not None]
            ids: list[Any] = (
                [r.genai_tokens for r in results]
                if isinstance(prompt, ov.Tensor)
                else [r.text for r in results]
            )
            out.append(
                BatchGenerationResult(
                    handle.request_id, ids, [r.score for r in results], handle.status, results
                )
            )
        if history is not None and handles[0].status != Status.CANCEL and out[0].results:
            # as genai: the turn and the first answer join the conversation
            history += [
                {"role": "user", "content": prompts[0]},
                {"role": "assistant", "content": out[0].results[0].text},
            ]
        return out
