"""``LLMPipeline``: text in, text out, shaped like ``openvino_genai.LLMPipeline``.

A face over the :class:`~npuw_kv.engine.Engine` (which ``ContinuousBatchingPipeline`` shares):
this module holds genai's call shapes and the chat.  Tokenizing, detokenizing, streaming text
and chat templates come from openvino-genai's ``Tokenizer`` / ``TextStreamer`` (prompts to ids:
:mod:`~npuw_kv.api.encoding`); genai's input forms are read by :mod:`~npuw_kv.api.inputs` and
the results shaped as genai's by :mod:`~npuw_kv.api.results` (docs/genai-compat.md).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np
import openvino as ov
import openvino_genai

from .api.chat_history import fit_history
from .api.chat_turns import check_turn_kind, token_turn
from .api.encoding import check_text
from .api.generation_config import GenerationConfig
from .api.generation_result import GenerationResult
from .api.inputs import Prompt
from .api.perf_metrics import CallTimer
from .api.results import DecodedResults, EncodedResults, TextResult, shape_results
from .config.pipeline_config import PipelineConfig
from .engine import Engine
from .errors import NumericError, UsageError
from .generation.decode import Streamer
from .generation.draft import record_genai_drafts
from .model.layout import KVLayout
from .runtime.runner import Runner

record_genai_drafts()  # openvino_genai.draft_model objects become readable


class LLMPipeline:
    """LLM pipeline on one KV cache that prefill and generate share in place.

    On CPU attention runs as the plugin's PagedAttention over our paged cache by default; the
    NPU path (and CPU with ``attention_backend="sdpa"``) runs static prefill/generate shapes
    over one buffer per layer through ROI views.

    ``model``: an IR directory, a ``.gguf`` file, or None / "smollm2" for the shipped default;
    or the :class:`~npuw_kv.engine.Engine` of another face (a ``ContinuousBatchingPipeline``'s),
    whose model, KV cache and running batch the calls then share.
    ``config``: :class:`~npuw_kv.config.PipelineConfig` fields or their NPUW names.  genai's
    forms work too: ``(models_path, device, properties)``, ``(models_path, tokenizer, device,
    ...)``, ``(model_xml, weights, tokenizer, device, generation_config, ...)`` and
    ``scheduler_config=`` on the paged path (:mod:`npuw_kv.api.inputs`).
    """

    def __init__(
        self, model: str | os.PathLike[str] | Engine | None = None, *args: Any, **config: Any
    ) -> None:
        if isinstance(model, Engine):  # a face over an engine built already (shared)
            if args or config:
                raise UsageError(
                    f"LLMPipeline(engine) takes no other settings (got {[*args, *config]}): "
                    "they were the engine's when it was built"
                )
            engine = model
        else:
            engine = Engine(model, args, config)
        self.engine = engine
        # what the model is and runs on (fixed once built)
        self.runner: Runner = engine.runner
        self.tokenizer: openvino_genai.Tokenizer = engine.tokenizer
        self.vocab_size: int = engine.vocab_size
        self.layout: KVLayout | None = engine.layout
        self.core: ov.Core = engine.core
        self.model_dir: Path | None = engine.model_dir
        self.trained_context = engine.trained_context
        self.load_time: float = engine.load_time
        self._history: list[dict[str, str]] | None = None
        # a chat of token-id turns: every turn's ids and answer so far (genai's stateful chat
        # with encoded inputs, where each turn gives only the tokens after the last answer)
        self._chat_ids: list[int] = []

    @property
    def config(self) -> PipelineConfig:
        """The settings it runs with, every ``auto`` decided."""
        return self.engine.config

    @property
    def batch_stats(self) -> dict[str, int]:
        """The last batched call's steps (also in :meth:`kv_stats`)."""
        return self.engine.batch_stats

    # -- genai-shaped accessors -------------------------------------------------------------
    def get_tokenizer(self) -> openvino_genai.Tokenizer:
        return self.tokenizer

    def get_generation_config(self) -> GenerationConfig:
        return GenerationConfig.build(self.engine.generation_config)

    def set_generation_config(self, config: GenerationConfig) -> None:
        """As genai: an unset ``eos_token_id`` keeps the model's."""
        self.engine.set_generation_config(config)

    # -- chat ---------------------------------------------------------------------------------
    def start_chat(self, system_message: str = "") -> None:
        with self.engine.exclusive():
            check_text(system_message)
            self._history = (
                [{"role": "system", "content": system_message}] if system_message else []
            )
            self._chat_ids = []

    def finish_chat(self) -> None:
        with self.engine.exclusive():
            self._history = None
            self._chat_ids = []

    def fit_chat_history(self, prompt: str) -> int:
        """Make room for ``prompt`` as the next user turn: when the chat would outgrow
        MAX_PROMPT_LEN, drop the oldest user/assistant exchanges (the system message stays)
        down to half of it, so the history stays a stable prefix whose KV the next turns reuse
        (:mod:`.chat_history`).  Returns how many exchanges were dropped.  If the prompt does
        not fit even alone, the history is left as it was and :meth:`generate` raises the usual
        error naming the setting.
        """
        with self.engine.exclusive():
            if self._history is None:
                raise UsageError("fit_chat_history needs chat mode: call start_chat() first")
            # the limit is never above the trained context (checked at construction)
            self._history, dropped = fit_history(
                self._history,
                prompt,
                lambda messages: int(self.engine.encoder.messages(messages).size),
                self.config.max_prompt_len,
            )
            return dropped

    # -- generation ---------------------------------------------------------------------------
    def encode(self, prompt: str, chat: bool = False, template: bool = True) -> np.ndarray:
        """Token ids of ``prompt``: as a user turn through the chat template (with the chat
        history when ``chat``), or as raw text when ``template`` is off or there is none."""
        history = list(self._history or []) if chat else None
        return self.engine.encoder.ids(Prompt(text=prompt), template, history)

    # for type checkers; ov.Tensor / TokenizedInputs (EncodedResults) and ChatHistory
    # (DecodedResults) are untyped, so they reach the implementation's signature
    @overload
    def generate(
        self, inputs: str, generation_config: Any = None, streamer: Streamer = None, **kw: Any
    ) -> TextResult: ...
    @overload
    def generate(
        self,
        inputs: Sequence[int] | np.ndarray,
        generation_config: Any = None,
        streamer: Streamer = None,
        **kw: Any,
    ) -> GenerationResult: ...
    @overload
    def generate(
        self,
        inputs: Sequence[str | Mapping[str, Any]],
        generation_config: Any = None,
        streamer: Streamer = None,
        **kw: Any,
    ) -> DecodedResults: ...
    def generate(
        self,
        inputs: Any,
        generation_config: Any = None,
        streamer: Streamer | None = None,
        **kwargs: Any,
    ) -> TextResult | DecodedResults | EncodedResults | GenerationResult:
        """Generate a continuation of ``inputs``, returning what openvino-genai returns.

        A text prompt gives a :class:`~npuw_kv.api.results.TextResult` (a ``str``; with
        ``num_return_sequences`` > 1 a ``DecodedResults``); a list of prompts, a
        ``ChatHistory`` or a list of messages ``DecodedResults``; an ``ov.Tensor`` or
        ``TokenizedInputs`` (a batch: one prompt per row, padding dropped by the attention
        mask) ``EncodedResults``; token ids as a list or array our ``GenerationResult``.
        On the paged path a call's prompts, and the calls of other threads, run together in
        batched steps (the static path runs them one after another).  ``generation_config``
        is ours, genai's or a dict; keyword arguments (genai's names) override it.
        ``streamer``: a callable taking text or a genai ``StreamerBase`` for a call with one
        answer, or a list with one of them (or None) per answer, prompt by prompt and sample by
        sample, to stream several answers at once.

        In chat mode (after :meth:`start_chat`) a text input is a user turn: the history goes
        through the model's chat template and the answer is appended to the history (unless the
        streamer cancelled the turn, as in openvino-genai).  A ``ChatHistory`` is used as it is
        and, as in genai, not changed.
        """
        try:
            return self._generate(inputs, generation_config, streamer, kwargs)
        except NumericError as exc:  # named with the settings that would remove it
            raise self.engine.numeric_error() from exc

    def _generate(
        self, inputs: Any, generation_config: Any, streamer: Streamer | None, kwargs: dict[str, Any]
    ) -> TextResult | DecodedResults | EncodedResults | GenerationResult:
        engine = self.engine
        with engine.exclusive():
            timer = CallTimer(self.load_time)
            config, alphas, request = engine.admit(
                inputs, generation_config, kwargs, streamer, self._history is not None
            )
            engine.assisted.start()
            parsing = streamer if isinstance(streamer, openvino_genai.TextParserStreamer) else None
            if parsing is not None:  # as genai: its parsers and message start afresh every call
                parsing.reset()
            chat = self._history is not None and request.kind in ("text", "texts")
            ids_turn = self._history is not None and request.kind in ("ids", "encoded")
            check_turn_kind(self._history, self._chat_ids, chat, ids_turn)
            if ids_turn:  # the turn's ids continue the chat's
                request = token_turn(request, self._chat_ids)
            detokenizer = None if request.kind in ("ids", "encoded") else self.tokenizer
            history = self._history if chat else None
            batch = engine.batch if engine.batchable() else None
            if batch is None:
                with engine.alone():  # other threads' batched calls end first
                    engine.use_adapters(alphas)
                    results = engine.run_alone(
                        request.prompts, config, streamer, history, timer, detokenizer
                    )
            else:
                sequences = engine.sequences(request.prompts, config, streamer, history, timer)
                if chat or ids_turn:  # the history is this call's until its answer is in it
                    ticket = batch.add(sequences, mode=alphas)
                    results = engine.batch_results(ticket, timer, detokenizer)
            if chat or ids_turn:
                self._record_turn(request.prompts[0], results[0], ids_turn)
        if batch is not None and not (chat or ids_turn):  # joins between two steps
            ticket = batch.add(sequences, mode=alphas)
            results = engine.batch_results(ticket, timer, detokenizer)
        metrics = timer.metrics()
        extended = engine.assisted.extended_metrics(metrics)  # a draft model's, as genai
        return shape_results(request.kind, results, metrics, extended, parsing)

    def _record_turn(self, prompt: Prompt, answer: GenerationResult, ids_turn: bool) -> None:
        """The chat's history gets the turn and its answer (not a cancelled one, as genai)."""
        if answer.finish_reason == "cancelled" or self._history is None:
            return
        if ids_turn:  # as genai, with the stop token (the next turn's ids follow it)
            assert prompt.ids is not None
            self._chat_ids = [*map(int, prompt.ids), *map(int, answer.genai_tokens)]
        else:
            self._history += [
                {"role": "user", "content": str(prompt.text)},
                {"role": "assistant", "content": answer.text},
            ]

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """``pipe(inputs, ...)`` is ``pipe.generate(inputs, ...)``, as in openvino-genai."""
        return self.generate(inputs, *args, **kwargs)

    # -- accounting ---------------------------------------------------------------------------
    def kv_stats(self) -> dict[str, Any]:
        """KV memory and host-copy accounting of the last request; ``max_live_sequences``:
        how many sequences run at once (the paged path's ``max_num_seqs``; the static-shape
        path runs one at a time)."""
        return self.engine.kv_stats()

    def set_kv_window_shares(self, shares: Any) -> None:
        """PagedAttention: split the prefix-cache room and host tier between the window
        pools anew (``kv_window_shares``; None: the default), dropping the cached prefixes.
        Bad shares raise a ``ValueError`` naming the setting, and change nothing."""
        self.engine.set_kv_window_shares(shares)
