"""``ContinuousBatchingPipeline``: openvino-genai's request-level API over npuw-kv's batch engine.

Requests are added at any time (:meth:`ContinuousBatchingPipeline.add_request`) and each
:meth:`~ContinuousBatchingPipeline.step` runs one batched model call over every live sequence
(:class:`~npuw_kv.runtime.paged.batch.BatchEngine`): new requests join between steps, finished
ones leave.  A request's :class:`GenerationHandle` reads its tokens as they come.  It runs on
the CPU path (PagedAttention) only; beam searches join the batch too, speculative decoding is
refused by name.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import openvino as ov
import openvino_genai

from .api.generation_config import GenerationConfig
from .api.generation_result import GenerationResult
from .api.inputs import MAX_SEQUENCES, Prompt
from .api.results import finish_reason
from .errors import UsageError
from .generation.beam_search import check_beam_request
from .generation.session import SequenceRequest, Ticket
from .pipeline import LLMPipeline
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
    sampling setting the logits could not take) raises its error from the reads."""

    def __init__(self, request_id: int, pipe: ContinuousBatchingPipeline) -> None:
        self.request_id = request_id
        self._pipe = pipe
        self._seqs: list[_Sequence] = []
        self._status = Status.RUNNING
        self._ticket = Ticket(on_token=self._on_token)

    def _on_token(self, engine_handle: int, token: int) -> None:
        for seq in self._seqs:
            if seq.engine_handle == engine_handle:
                seq.output.generated_ids.append(token)

    def _sync(self) -> None:
        """Take the outcomes of the sequences that finished in the steps since (a beam
        search's several results become as many sequences)."""
        if self._status != Status.RUNNING:
            return
        seqs: list[_Sequence] = []
        for seq in self._seqs:
            outcome = self._ticket.outcomes.get(seq.engine_handle)
            if outcome is None or seq.result is not None:
                seqs.append(seq)
                continue
            if isinstance(outcome, Exception):
                self._pipe._end(self, Status.IGNORED)
                raise outcome
            for result in outcome if isinstance(outcome, list) else [outcome]:
                seqs.append(_Sequence(seq.engine_handle, _output(result), result, seq.read_upto))
        self._seqs = seqs
        if all(s.result is not None for s in self._seqs):
            self._status = Status.FINISHED

    def get_status(self) -> Any:
        self._sync()
        return self._status

    def can_read(self) -> bool:
        """True when some sequence has tokens not read yet."""
        self._sync()
        return any(len(s.output.generated_ids) > s.read_upto for s in self._seqs)

    def read(self) -> dict[int, GenerationOutput]:
        """Each sequence's tokens since the last read, by sequence index."""
        self._sync()
        out = {}
        for i, seq in enumerate(self._seqs):
            new = seq.output.generated_ids[seq.read_upto :]
            if new:
                logprobs = seq.output.generated_log_probs[seq.read_upto :]
                out[i] = GenerationOutput(new, logprobs, seq.output.score, seq.output.finish_reason)
                seq.read_upto = len(seq.output.generated_ids)
        return out

    def read_all(self) -> list[GenerationOutput]:
        """Every sequence's whole output (complete once the status is not RUNNING)."""
        self._sync()
        return [s.output for s in self._seqs]

    def stop(self) -> None:
        """End the request now, keeping what it generated (status STOP)."""
        self._pipe._end(self, Status.STOP)

    def cancel(self) -> None:
        """End the request now and drop what it generated (status CANCEL)."""
        self._pipe._end(self, Status.CANCEL)


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
    over an :class:`~npuw_kv.pipeline.LLMPipeline` on the CPU path."""

    def __init__(
        self,
        models_path: str | os.PathLike[str] | None,
        scheduler_config: Any = None,
        device: str = "CPU",
        properties: dict[str, Any] | None = None,
        tokenizer_properties: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if tokenizer_properties:
            raise UsageError(
                f"tokenizer_properties {sorted(tokenizer_properties)} are not supported: the "
                "tokenizer is loaded as openvino-genai's LLMPipeline loads it"
            )
        settings = {**(properties or {}), **kwargs}
        if scheduler_config is not None:
            settings["scheduler_config"] = scheduler_config
        self.pipeline = LLMPipeline(models_path, device, **settings)
        runner = self.pipeline.runner
        if not isinstance(runner, PagedRunner):
            raise UsageError(
                "ContinuousBatchingPipeline runs on the paged path (device CPU, "
                "attention_backend 'pa'); the static-shape path runs one sequence at a time"
            )
        if self.pipeline._assisted.mode is not None:
            raise UsageError(
                "ContinuousBatchingPipeline does not run speculative decoding (draft_model, "
                "prompt_lookup): use LLMPipeline, which runs it one sequence at a time"
            )
        self.runner = runner
        assert self.pipeline._session is not None
        self.session = self.pipeline._session  # the pipeline's own: its calls join it too
        self._request_ids = itertools.count(1 << 40)  # generate()'s own requests

    # -- genai's accessors -----------------------------------------------------------------------
    def get_tokenizer(self) -> openvino_genai.Tokenizer:
        return self.pipeline.get_tokenizer()

    def get_config(self) -> GenerationConfig:
        return self.pipeline.get_generation_config()

    def has_non_finished_requests(self) -> bool:
        return self.session.busy

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, request_id: int, prompt: Any, generation_config: Any) -> GenerationHandle:
        """Queue a request: ``prompt`` as text (through the chat template when the config's
        ``apply_chat_template`` is on and the model has one) or token ids (``ov.Tensor``)."""
        pipe = self.pipeline
        config = pipe._call_config(generation_config, {})
        alphas = pipe._alphas(config)  # LoRA: an adapter not registered is refused here
        if isinstance(prompt, ov.Tensor):
            ids = np.asarray(prompt.data, np.int64).reshape(-1)
        elif isinstance(prompt, str):
            ids = pipe._encoder.ids(Prompt(text=prompt), config.apply_chat_template)
        else:
            raise UsageError(f"prompt must be a str or an ov.Tensor of token ids, got {prompt!r}")
        if config.num_return_sequences > MAX_SEQUENCES:
            raise UsageError(
                f"num_return_sequences={config.num_return_sequences}: at most {MAX_SEQUENCES} "
                "per request"
            )
        handle = GenerationHandle(int(request_id), self)
        factory = pipe._constraint(config)
        beams = config.num_beams > 1
        if beams:
            check_beam_request(config, None, factory)
        sequences = [
            SequenceRequest(ids, config, sample, factory() if factory is not None else None)
            for sample in range(1 if beams else config.num_return_sequences)
        ]
        # when the batch starts, its pools are sized for as many requests of this one's size
        # as may run at once
        self.session.add(
            sequences,
            handle._ticket,
            at_once=self.session.engine.max_num_seqs,
            mode=alphas,
        )
        handle._seqs = [_Sequence(h) for h in handle._ticket.handles]
        return handle

    def step(self) -> None:
        """One batched model call over every live sequence; their handles grow."""
        self.session.step()

    def _end(self, handle: GenerationHandle, status: Any) -> None:
        """Stop or cancel ``handle``'s request: its sequences leave the engine now."""
        if handle._status != Status.RUNNING:
            return
        self.session.drop([s.engine_handle for s in handle._seqs if s.result is None])
        if status == Status.CANCEL:
            for seq in handle._seqs:
                seq.output = GenerationOutput()
        handle._status = status

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
                handles.append(self.add_request(next(self._request_ids), p, c))
        except BaseException:
            for handle in handles:  # the call fails whole: the requests it added end too
                handle.cancel()
            raise
        while any(h.get_status() == Status.RUNNING for h in handles):
            self.step()
        out = []
        for handle, prompt in zip(handles, prompts, strict=True):
            results = [s.result for s in handle._seqs if s.result is not None]
            ids: list[Any] = (
                [r.genai_tokens for r in results]
                if isinstance(prompt, ov.Tensor)
                else [r.text for r in results]
            )
            out.append(
                BatchGenerationResult(
                    handle.request_id, ids, [r.score for r in results], handle._status, results
                )
            )
        return out
