"""``LLMPipeline``: text in, text out, shaped like ``openvino_genai.LLMPipeline``.

Tokenizing, detokenizing, streaming text and chat templates come from openvino-genai's
``Tokenizer`` / ``TextStreamer`` (prompts to ids: :mod:`~npuw_kv.api.encoding`);
:mod:`~npuw_kv.generation.decode` runs the generation loop over a runner (paged or static-shape);
genai's input forms are read by :mod:`~npuw_kv.api.inputs` and the results shaped as genai's by
:mod:`~npuw_kv.api.results` (docs/genai-compat.md).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any, overload

import numpy as np
import openvino as ov
import openvino_genai

from .api.chat_history import fit_history
from .api.chat_prefix import system_prompt_tokens
from .api.chat_turns import check_turn_kind, token_turn
from .api.encoding import PromptEncoder, check_text, load_tokenizer
from .api.generation_config import GenerationConfig
from .api.generation_result import GenerationResult
from .api.inputs import Prompt, check_request, read_inputs
from .api.perf_metrics import CallTimer
from .api.pipeline_args import (
    model_directory,
    pipeline_args,
    scheduler_cache_bytes,
    scheduler_settings,
)
from .api.results import DecodedResults, EncodedResults, TextResult, shape_results
from .config.decide import cpu_precision, npuw_uses_cpu
from .config.pipeline_config import PipelineConfig
from .config.settings import label
from .errors import NumericError, UsageError
from .generation import speculative
from .generation.decode import Streamer, generate_sequences
from .generation.draft import record_genai_drafts
from .generation.session import REENTERED, BatchSession, SequenceRequest, Ticket, requests
from .model.source import family_named, read_ir, trained_context
from .runtime.adapters import Alphas, LoraSwitch, no_adapters
from .runtime.build import build_runner
from .runtime.heap import fix_mmap_threshold, release_free_heap
from .runtime.paged.runner import PagedRunner
from .runtime.runner import Runner

record_genai_drafts()  # openvino_genai.draft_model objects become readable


class LLMPipeline:
    """LLM pipeline on one KV cache that prefill and generate share in place.

    On CPU attention runs as the plugin's PagedAttention over our paged cache by default; the
    NPU path (and CPU with ``attention_backend="sdpa"``) runs static prefill/generate shapes
    over one buffer per layer through ROI views.

    ``model``: an IR directory, a ``.gguf`` file, or None / "smollm2" for the shipped default.
    ``config``: :class:`~npuw_kv.config.PipelineConfig` fields or their NPUW names.  genai's
    forms work too: ``(models_path, device, properties)``, ``(models_path, tokenizer, device,
    ...)``, ``(model_xml, weights, tokenizer, device, generation_config, ...)`` and
    ``scheduler_config=`` on the paged path (:mod:`npuw_kv.api.inputs`).
    """

    def __init__(
        self, model: str | os.PathLike[str] | None = None, *args: Any, **config: Any
    ) -> None:
        started = time.perf_counter()
        given = pipeline_args(model, args, config)
        assisted = speculative.take_settings(given.settings)  # prompt_lookup, draft_model
        settings = given.settings
        cache_bytes = 0  # genai's SchedulerConfig.cache_size, once bytes per token are known
        if given.scheduler_config is not None:
            checked = scheduler_settings(given.scheduler_config, given.device, settings)
            cache_bytes = scheduler_cache_bytes(given.scheduler_config, settings)
            settings = checked
        self.config = PipelineConfig.from_kwargs(given.device, **settings)
        plan = speculative.plan(assisted, self.config)  # refused before compiling
        self._settings = dict(settings)  # as given, for messages
        # a call's preparation (settings, chat history, tokenizing) and every call that needs
        # the runner alone (the static path, speculative decoding, chat turns) take it; the paged
        # path's batched calls then run together in the batch session (generation/session.py)
        self._lock = threading.Lock()
        self._owner: int | None = None
        fix_mmap_threshold()  # before compiling: see runtime/heap.py for what it keeps flat
        with model_directory(given, self.config.gguf_zero_points) as model_dir:
            # None for a model given in memory (its temporary directory is gone after this)
            self.model_dir: Path | None = None if given.weights is not None else model_dir
            # (positions, where it was read); generation never goes past it
            self.trained_context = trained_context(model_dir)
            kv_capacity = self.config.kv_capacity(self.trained_context)
            self.core = ov.Core()
            ir = read_ir(self.core, model_dir)
            # before compiling: a broken tokenizer should not cost a compile first
            self.tokenizer = (
                load_tokenizer(model_dir) if given.tokenizer is None else given.tokenizer
            )
            adapters = given.adapters.get_adapters() if given.adapters else []
            with family_named(model_dir):  # a graph we cannot take: which family
                built = build_runner(
                    self.core, model_dir, ir, self.config, kv_capacity, settings, adapters
                )
            del ir  # the device holds its own copy of the graph now
        self.runner: Runner = built.runner
        self._encoder = PromptEncoder(self.tokenizer)
        self.config, self.vocab_size, self.layout = built.config, built.vocab_size, built.layout
        self._decided = built.decided  # what NaN logits are blamed on (_numeric_error)
        self._assisted = speculative.Assisted.build(plan, self, settings)
        # LoRA: the adapters registered here, a call choosing among them (runtime/adapters.py)
        self._lora = (
            LoraSwitch(built.lora, built.requests, given.adapters)
            if built.lora is not None and given.adapters is not None
            else None
        )
        self.generation_config = GenerationConfig(
            eos_token_id=self.tokenizer.get_eos_token_id(),
            adapters=given.adapters if given.adapters else None,
        )
        if given.generation_config is not None:
            self.set_generation_config(given.generation_config)
        self._history: list[dict[str, str]] | None = None
        # a chat of token-id turns: every turn's ids and answer so far (genai's stateful chat
        # with encoded inputs, where each turn gives only the tokens after the last answer)
        self._chat_ids: list[int] = []
        # the user sized the paged KV room: batches are preempted in it rather than grow it
        self._kv_room_given = "prefix_cache_tokens" in {
            PipelineConfig.setting_name(key) for key in settings if key != "compile_properties"
        }
        if cache_bytes and isinstance(self.runner, PagedRunner):
            self.runner.size_cache(cache_bytes, "scheduler_config.cache_size")
            self._kv_room_given = True
        self.batch_stats: dict[str, int] = {}  # the last batched call's steps (kv_stats)
        # the paged path's running batch, which calls from several threads join
        self._session = (
            BatchSession(
                self.runner,
                self.tokenizer,
                self.config.max_num_seqs,
                self.trained_context[0] if self.trained_context else None,
                fit_pools=not self._kv_room_given,
                split_fuse=self.config.split_fuse,
                mode=self._lora.current if self._lora is not None else None,
                switch=self._use_adapters,
            )
            if isinstance(self.runner, PagedRunner)
            else None
        )
        # the graph we prepared and the compiler's temporaries were freed into the C heap, which
        # keeps the pages: give them back (-12 MB peak RSS on SmolLM2)
        release_free_heap()
        self.load_time = 1000.0 * (time.perf_counter() - started)  # ms, as genai's

    def _alphas(self, config: GenerationConfig) -> Alphas | None:
        """The LoRA alphas a call runs with (None: the pipeline has no adapters)."""
        if self._lora is None:
            no_adapters(config.adapters)
            return None
        return self._lora.alphas(config.adapters)

    def _use_adapters(self, alphas: Alphas | None) -> None:
        """Run with ``alphas`` from now on (nothing may be live): the KV cached under other
        alphas is dropped."""
        if self._lora is not None and alphas is not None and self._lora.set(alphas):
            self.runner.forget_prefixes()
            if self._session is not None:
                self._session.mode = alphas

    def _alone(self) -> AbstractContextManager[None]:
        """The runner alone: the batch emptied and closed to new requests meanwhile."""
        return self._session.alone() if self._session is not None else nullcontext()

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """The pipeline's lock (a second caller waits for the first); a call made from inside
        a running one (e.g. from its streamer) is refused, not deadlocked."""
        me = threading.get_ident()
        if self._owner == me:
            raise RuntimeError(REENTERED)
        with self._lock:
            self._owner = me
            try:
                yield
            finally:
                self._owner = None

    # -- genai-shaped accessors -------------------------------------------------------------
    def get_tokenizer(self) -> openvino_genai.Tokenizer:
        return self.tokenizer

    def get_generation_config(self) -> GenerationConfig:
        return GenerationConfig.build(self.generation_config)

    def set_generation_config(self, config: GenerationConfig) -> None:
        """As genai: an unset ``eos_token_id`` keeps the model's."""
        self.generation_config = GenerationConfig.build(config)
        eos = self.generation_config.eos_token_id
        if eos is None or eos < 0:
            self.generation_config.eos_token_id = self.tokenizer.get_eos_token_id()

    # -- chat ---------------------------------------------------------------------------------
    def start_chat(self, system_message: str = "") -> None:
        with self._exclusive():
            check_text(system_message)
            self._history = (
                [{"role": "system", "content": system_message}] if system_message else []
            )
            self._chat_ids = []

    def finish_chat(self) -> None:
        with self._exclusive():
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
        with self._exclusive():
            if self._history is None:
                raise UsageError("fit_chat_history needs chat mode: call start_chat() first")
            # the limit is never above the trained context (checked at construction)
            self._history, dropped = fit_history(
                self._history,
                prompt,
                lambda messages: int(self._encoder.messages(messages).size),
                self.config.max_prompt_len,
            )
            return dropped

    # -- generation ---------------------------------------------------------------------------
    def encode(self, prompt: str, chat: bool = False, template: bool = True) -> np.ndarray:
        """Token ids of ``prompt``: as a user turn through the chat template (with the chat
        history when ``chat``), or as raw text when ``template`` is off or there is none."""
        history = list(self._history or []) if chat else None
        return self._encoder.ids(Prompt(text=prompt), template, history)

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
            raise self._numeric_error() from exc

    def _generate(
        self, inputs: Any, generation_config: Any, streamer: Streamer | None, kwargs: dict[str, Any]
    ) -> TextResult | DecodedResults | EncodedResults | GenerationResult:
        with self._exclusive():
            timer = CallTimer(self.load_time)
            config = self._call_config(generation_config, kwargs)
            alphas = self._alphas(config)  # an adapter not registered is refused first
            self._assisted.check(config)  # assisted-generation fields need prompt_lookup/draft
            request = read_inputs(inputs, self.vocab_size)
            check_request(request, config, streamer, self._history is not None)
            parsing = streamer if isinstance(streamer, openvino_genai.TextParserStreamer) else None
            if parsing is not None:  # as genai: its parsers and message start afresh every call
                parsing.reset()
            chat = self._history is not None and request.kind in ("text", "texts")
            ids_turn = self._history is not None and request.kind in ("ids", "encoded")
            check_turn_kind(self._history, self._chat_ids, chat, ids_turn)
            if ids_turn:  # the turn's ids continue the chat's
                request = token_turn(request, self._chat_ids)
            detokenizer = None if request.kind in ("ids", "encoded") else self.tokenizer
            session = self._session if self._batchable(config) else None
            if session is None:
                with self._alone():  # other threads' batched calls end first
                    self._use_adapters(alphas)
                    results = self._run_alone(
                        request.prompts, config, streamer, chat, timer, detokenizer
                    )
            else:
                sequences = self._sequences(request.prompts, config, streamer, chat, timer)
                if chat or ids_turn:  # the history is this call's until its answer is in it
                    ticket = session.add(sequences, mode=alphas)
                    results = self._batch_results(session, ticket, timer, detokenizer)
            if chat or ids_turn:
                self._record_turn(request.prompts[0], results[0], ids_turn)
        if session is not None and not (chat or ids_turn):  # joins between two steps
            ticket = session.add(sequences, mode=alphas)
            results = self._batch_results(session, ticket, timer, detokenizer)
        metrics = timer.metrics()
        extended = self._assisted.extended_metrics(metrics)  # a draft model's, as genai
        return shape_results(request.kind, results, metrics, extended, parsing)

    def _numeric_error(self) -> NumericError:
        """NaN / +inf logits, naming only the settings that would keep the values wider."""
        decided, remedies = self._decided, []
        compute = decided.compute_precision
        if npuw_uses_cpu(decided.npuw_devices):  # NPUW's CPU sub-models
            compute = cpu_precision(self.core, decided.config)
        if decided.npuw_f16:
            remedies.append("set NPUW_F16IC=NO (f32 tensors between NPUW's sub-graphs)")
        if compute != "f32":
            remedies.append("compute in f32 with INFERENCE_PRECISION_HINT=f32")
        if decided.kv_precision not in ("f32", None):
            remedies.append("store KV in f32 with kv_precision='f32'")
        return NumericError.with_remedies(remedies)

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

    def _batchable(self, config: GenerationConfig) -> bool:
        """Whether this call's sequences run in the paged path's shared batch (joining other
        threads' calls): all but speculative decoding, which runs its own steps, and the
        static-shape path, which runs one sequence at a time."""
        return self._session is not None and self._assisted.mode is None

    def _sequences(
        self,
        prompts: Sequence[Prompt],
        config: GenerationConfig,
        streamer: Streamer | None,
        chat: bool,
        timer: CallTimer,
    ) -> list[SequenceRequest]:
        """The call's sequences for the batch session (:func:`.generation.session.requests`)."""
        history = self._history if chat else None
        return requests(
            self._encoder, self.tokenizer, prompts, config, streamer, history, timer,
            self._constraint(config, timer),
        )  # fmt: skip

    def _batch_results(
        self, session: BatchSession, ticket: Ticket, timer: CallTimer, detokenizer: Any
    ) -> list[GenerationResult]:
        """Wait for the ticket's sequences; account the steps they ran in."""
        requests = session.wait(ticket)
        timer.batch_done(ticket.times, requests, detokenizer)
        self.batch_stats = {
            "batch_steps": len(ticket.times.ends),
            "batch_peak_sequences": max(ticket.times.sizes, default=0),
            "batch_preemptions": ticket.times.preemptions,
        }
        return [r for results in requests for r in results]

    def _run_alone(
        self,
        prompts: Sequence[Prompt],
        config: GenerationConfig,
        streamer: Streamer | None,
        chat: bool,
        timer: CallTimer,
        detokenizer: Any,
    ) -> list[GenerationResult]:
        """The prompts one after another on the runner alone (speculative decoding, the
        static-shape path)."""
        if config.num_beams > 1:
            raise UsageError(
                "num_beams > 1 needs the PagedAttention path (the CPU default, "
                "attention_backend='pa') without speculative decoding; the static-shape path "
                "(NPU, attention_backend='sdpa') runs one sequence per call"
            )
        limit = self.trained_context[0] if self.trained_context else None
        results: list[GenerationResult] = []
        for index, prompt in enumerate(prompts):
            started = timer.now()
            history = self._history if chat else None
            ids = self._encoder.ids(prompt, config.apply_chat_template, history, timer)
            timer.inputs += int(ids.size)
            # a chat's system prompt: its KV cached longest (PagedAttention's priorities)
            if prompt.ids is None:
                messages = self._history if chat else prompt.messages
                self.runner.hold_prefix(system_prompt_tokens(self.tokenizer, messages, ids))
            runner = timer.runner(self._assisted.runner(self.runner, config))
            answers = generate_sequences(
                runner,
                self.tokenizer,
                ids,
                config,
                streamer=_prompt_streamers(streamer, index, config.num_return_sequences),
                position_limit=limit,
                make_constraint=self._constraint(config, timer),
            )
            self._assisted.finish()  # speculative decoding: drop unused candidates' KV
            timer.prompt_done(runner, started, answers, detokenizer)
            results += answers
        return results

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """``pipe(inputs, ...)`` is ``pipe.generate(inputs, ...)``, as in openvino-genai."""
        return self.generate(inputs, *args, **kwargs)

    def _call_config(self, generation_config: Any, kwargs: dict[str, Any]) -> GenerationConfig:
        if isinstance(generation_config, Mapping):  # genai takes a dict of settings too
            kwargs, generation_config = {**generation_config, **kwargs}, None
        config = GenerationConfig.build(generation_config or self.generation_config, **kwargs)
        if config.eos_token_id is None or config.eos_token_id < 0:  # genai's unset is -1
            config.eos_token_id = self.tokenizer.get_eos_token_id()
        return config

    def _constraint(
        self, config: GenerationConfig, timer: CallTimer | None = None
    ) -> Callable[[], Any] | None:
        """Structured output: a fresh grammar constraint per sequence
        (npuw_kv.generation.structured); its compile time goes to ``timer``."""
        if config.structured_output_config is None:
            return None
        from .generation.structured import constraint_for

        def make() -> Any:
            constraint = constraint_for(
                config.structured_output_config, self.tokenizer, self.vocab_size, config.stop_ids()
            )
            if timer is not None and constraint is not None:
                timer.raw.grammar_compile_times.append(constraint.compile_us)
                timer.grammar_init["xgrammar"] = constraint.backend_init_us
            return constraint

        return make

    # -- accounting ---------------------------------------------------------------------------
    def kv_stats(self) -> dict[str, Any]:
        """KV memory and host-copy accounting of the last request; ``max_live_sequences``:
        how many sequences run at once (the paged path's ``max_num_seqs``; the static-shape
        path runs one at a time)."""
        live = {"max_live_sequences": self.config.max_num_seqs if self._session else 1}
        return {**self.runner.stats(), **self._assisted.stats(), **self.batch_stats, **live}

    def set_kv_window_shares(self, shares: Any) -> None:
        """PagedAttention: split the prefix-cache room and host tier between the window
        pools anew (``kv_window_shares``; None: the default), dropping the cached prefixes.
        Bad shares raise a ``ValueError`` naming the setting, and change nothing."""
        with self._exclusive():
            if not isinstance(self.runner, PagedRunner):
                raise UsageError(
                    f"{label('kv_window_shares')} applies to attention_backend='pa'; this "
                    "pipeline runs the static-shape path, which has no window pools"
                )
            with self._alone():  # the pools are allocated anew
                text = self.runner.set_window_shares(shares, label("kv_window_shares"))
            self.config = replace(self.config, kv_window_shares=text)


def _prompt_streamers(streamer: Any, prompt: int, samples: int) -> Any:
    """Prompt ``prompt``'s streamers out of a call's list (one per answer), or the one."""
    if isinstance(streamer, (list, tuple)):
        return list(streamer[prompt * samples : (prompt + 1) * samples])
    return streamer
