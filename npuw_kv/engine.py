"""The engine under both pipeline faces: one loaded model, its runner and what a call needs.

``LLMPipeline`` (genai's text-in, text-out face, with chat) and ``ContinuousBatchingPipeline``
(genai's request-level face) are both thin faces over an :class:`Engine`, as genai puts its two
pipelines over one implementation: the model is read and compiled here, a call's settings are
built and checked here (``GenerationConfig``, LoRA alphas, structured output, assisted
generation), and its sequences run here, in the paged path's running batch
(:mod:`~npuw_kv.generation.running_batch`) or on the runner alone.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import openvino as ov

from .api.chat_prefix import system_prompt_tokens
from .api.encoding import PromptEncoder, load_tokenizer
from .api.generation_config import GenerationConfig
from .api.generation_result import GenerationResult
from .api.inputs import Prompt, Request, check_request, read_inputs
from .api.perf_metrics import CallTimer
from .api.pipeline_args import (
    model_directory,
    pipeline_args,
    scheduler_cache_bytes,
    scheduler_settings,
)
from .config.decide import cpu_precision, npuw_uses_cpu
from .config.pipeline_config import PipelineConfig
from .config.settings import label
from .errors import NumericError, UsageError
from .generation import prompt_scores, speculative
from .generation.beams_alone import beams_alone
from .generation.decode import Streamer, generate_sequences
from .generation.running_batch import REENTERED, RunningBatch, SequenceRequest, Ticket, requests
from .model.families import family_named, trained_context
from .model.source import read_ir
from .runtime.adapters import Alphas, LoraSwitch, no_adapters
from .runtime.build import build_runner
from .runtime.heap import fix_mmap_threshold, release_free_heap
from .runtime.paged.runner import PagedRunner
from .runtime.runner import Runner
from .runtime.static.slot_scheduler import SlotScheduler

History = list[dict[str, str]]


class Engine:
    """A model compiled into a runner, with the tokenizer, settings and running batch that
    every call on it shares.  Arguments as ``LLMPipeline``'s (:mod:`npuw_kv.api.inputs`)."""

    def __init__(
        self,
        model: str | os.PathLike[str] | None,
        args: Sequence[Any],
        config: dict[str, Any],
        tokenizer_properties: Mapping[Any, Any] | None = None,
    ) -> None:
        """``tokenizer_properties``: what the tokenizer's IRs are compiled with (genai's)."""
        started = time.perf_counter()
        given = pipeline_args(model, tuple(args), config)
        assisted = speculative.take_settings(given.settings)  # prompt_lookup, draft_model
        settings = given.settings
        cache_bytes = 0  # genai's SchedulerConfig.cache_size, once bytes per token are known
        if given.scheduler_config is not None:
            checked = scheduler_settings(given.scheduler_config, given.device, settings)
            cache_bytes = scheduler_cache_bytes(given.scheduler_config, settings)
            settings = checked
        self.config = PipelineConfig.from_kwargs(given.device, **settings)
        plan = speculative.plan(assisted, self.config)  # refused before compiling
        # a call's preparation (settings, chat history, tokenizing) and every call that needs
        # the runner alone (the static path, speculative decoding, chat turns) take it; the paged
        # path's batched calls then run together in the running batch
        self._lock = threading.Lock()
        self._owner: int | None = None
        fix_mmap_threshold()  # before compiling: see runtime/heap.py for what it keeps flat
        if given.tokenizer is not None and tokenizer_properties:
            raise UsageError(
                "tokenizer_properties compile the model's own tokenizer IRs: not with a "
                "tokenizer given (compile it with them yourself)"
            )
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
                load_tokenizer(model_dir, tokenizer_properties)
                if given.tokenizer is None
                else given.tokenizer
            )
            adapters = given.adapters.get_adapters() if given.adapters else []
            with family_named(model_dir):  # a graph we cannot take: which family
                built = build_runner(
                    self.core,
                    model_dir,
                    ir,
                    self.config,
                    kv_capacity,
                    settings,
                    adapters,
                    tree_mask=plan[0] == "draft_model",  # a draft's tree checked in one call
                )
            del ir  # the device holds its own copy of the graph now
        self.runner: Runner = built.runner
        self.encoder = PromptEncoder(self.tokenizer)
        self.config, self.vocab_size, self.layout = built.config, built.vocab_size, built.layout
        self.decided = built.decided  # what NaN logits are blamed on (numeric_error)
        self.assisted = speculative.Assisted.build(plan, self, settings)
        # LoRA: the adapters registered here, a call choosing among them (runtime/adapters.py)
        self.lora = (
            LoraSwitch(built.lora, built.requests, given.adapters)
            if built.lora is not None and given.adapters is not None
            else None
        )
        self.generation_config = GenerationConfig(
            adapters=given.adapters if given.adapters else None
        )
        self.fill_eos(self.generation_config)
        if given.generation_config is not None:
            self.set_generation_config(given.generation_config)
        # the user sized the paged KV room: batches are preempted in it rather than grow it
        room_given = "prefix_cache_tokens" in {
            PipelineConfig.setting_name(key) for key in settings if key != "compile_properties"
        }
        if cache_bytes and isinstance(self.runner, PagedRunner):
            self.runner.size_cache(cache_bytes, "scheduler_config.cache_size")
            room_given = True
        self.batch_stats: dict[str, int] = {}  # the last batched call's steps (kv_stats)
        # the running batch that calls from several threads join: the paged path's, or the
        # static path's slots with packed generate models
        self.batch = (
            RunningBatch(
                self.runner,
                self.tokenizer,
                max_num_seqs=self.config.max_num_seqs,
                position_limit=self.trained_context[0] if self.trained_context else None,
                fit_pools=not room_given,
                split_fuse=self.config.split_fuse,
                mode=self.lora.current if self.lora is not None else None,
                switch=self.use_adapters,
                assisted=self.assisted,
                scheduler=SlotScheduler(built.packed) if built.packed is not None else None,
            )
            if isinstance(self.runner, PagedRunner) or built.packed is not None
            else None
        )
        # the graph we prepared and the compiler's temporaries were freed into the C heap, which
        # keeps the pages: give them back (the figure: docs/measurements.md)
        release_free_heap()
        self.load_time = 1000.0 * (time.perf_counter() - started)  # ms, as genai's

    # -- a call's settings --------------------------------------------------------------------
    def set_generation_config(self, config: GenerationConfig) -> None:
        """As genai: an unset ``eos_token_id`` keeps the model's."""
        config = GenerationConfig.build(config)
        self.fill_eos(config)
        config.validate()
        self.generation_config = config

    def call_config(self, generation_config: Any, kwargs: Mapping[str, Any]) -> GenerationConfig:
        """A call's config: ours, genai's or a dict (None: the default), ``kwargs`` over it."""
        if isinstance(generation_config, Mapping):  # genai takes a dict of settings too
            kwargs, generation_config = {**generation_config, **kwargs}, None
        config = GenerationConfig.build(generation_config or self.generation_config, **kwargs)
        self.fill_eos(config)
        config.validate()
        return config

    def fill_eos(self, config: GenerationConfig) -> None:
        """As genai: a config without an EOS takes the tokenizer's."""
        eos = self.tokenizer.get_eos_token_id()
        if config.eos_token_id < 0 and eos >= 0:
            config.set_eos_token_id(eos)

    def admit(
        self,
        inputs: Any,
        generation_config: Any,
        kwargs: Mapping[str, Any],
        streamer: Any = None,
        chatting: bool = False,
    ) -> tuple[GenerationConfig, Alphas | None, Request]:
        """The one check every entry point makes before any work (``LLMPipeline.generate``,
        ``ContinuousBatchingPipeline.add_request`` / ``generate``, and through them the server
        and the CLI), so one bad input gets one refusal everywhere: the call's config, its
        LoRA alphas (an adapter not registered is refused first), and its prompts."""
        config = self.call_config(generation_config, kwargs)
        alphas = self.alphas(config)
        self.assisted.check(config)  # assisted-generation fields need prompt_lookup / a draft
        request = read_inputs(inputs, self.vocab_size)
        check_request(request, config, streamer, chatting)
        prompt_scores.check(config)
        return config, alphas, request

    def alphas(self, config: GenerationConfig) -> Alphas | None:
        """The LoRA alphas a call runs with (None: the engine has no adapters); an adapter
        not registered is refused here."""
        if self.lora is None:
            no_adapters(config.adapters)
            return None
        return self.lora.alphas(config.adapters)

    def use_adapters(self, alphas: Alphas | None) -> None:
        """Run with ``alphas`` from now on (nothing may be live): the KV cached under other
        alphas is dropped."""
        if self.lora is not None and alphas is not None and self.lora.set(alphas):
            self.runner.forget_prefixes()
            if self.batch is not None:
                if isinstance(self.batch.scheduler, SlotScheduler):  # every slot's, not one
                    self.batch.scheduler.forget_prefixes()
                self.batch.mode = alphas

    def constraint(
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

    # -- who runs now -------------------------------------------------------------------------
    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """The engine's lock (a second caller waits for the first); a call made from inside a
        running one (e.g. from its streamer) is refused, not deadlocked."""
        me = threading.get_ident()
        if self._owner == me:
            raise RuntimeError(REENTERED)
        with self._lock:
            self._owner = me
            try:
                yield
            finally:
                self._owner = None

    def alone(self) -> AbstractContextManager[None]:
        """The runner alone: the batch emptied and closed to new requests meanwhile."""
        return self.batch.alone() if self.batch is not None else nullcontext()

    def batchable(self) -> bool:
        """Whether calls run in the paged path's shared batch (joining other threads' calls):
        all but speculative decoding, which runs its own steps, and the static-shape path,
        which runs one sequence at a time."""
        return self.batch is not None and self.assisted.mode is None

    # -- running sequences --------------------------------------------------------------------
    def sequences(
        self,
        prompts: Sequence[Prompt],
        config: GenerationConfig,
        streamer: Streamer | None,
        history: History | None,
        timer: CallTimer,
    ) -> list[SequenceRequest]:
        """A call's sequences for the running batch (:func:`.generation.running_batch.requests`)."""
        return requests(
            self.encoder, self.tokenizer, prompts, config, streamer, history, timer,
            self.constraint(config, timer),
        )  # fmt: skip

    def batch_results(
        self, ticket: Ticket, timer: CallTimer, detokenizer: Any
    ) -> list[GenerationResult]:
        """Wait for the ticket's sequences; account the steps they ran in."""
        assert self.batch is not None
        done = self.batch.wait(ticket)
        timer.batch_done(ticket.times, done, detokenizer)
        self.batch_stats = {
            "batch_steps": len(ticket.times.ends),
            "batch_peak_sequences": max(ticket.times.sizes, default=0),
            "batch_preemptions": ticket.times.preemptions,
        }
        return [r for results in done for r in results]

    def run_alone(
        self,
        prompts: Sequence[Prompt],
        config: GenerationConfig,
        streamer: Streamer | None,
        history: History | None,
        timer: CallTimer,
        detokenizer: Any,
    ) -> list[GenerationResult]:
        """The prompts one after another on the runner alone (speculative decoding, the
        static-shape path); the caller holds :meth:`alone`, so ``kv_stats`` reports them."""
        beams = config.num_beams > 1
        if beams and (self.decided.config.device != "CPU" or self.assisted.mode is not None):
            raise UsageError(
                f"num_beams > 1 runs without speculative decoding on the CPU (the "
                f"PagedAttention path, or the static-shape path one beam at a time) and on the "
                f"NPU path in its slots (max_num_seqs > 1); the "
                f"{self.decided.config.device} path here runs one sequence per call"
            )
        limit = self.trained_context[0] if self.trained_context else None
        results: list[GenerationResult] = []
        for index, prompt in enumerate(prompts):
            started = timer.now()
            ids = self.encoder.ids(prompt, config.apply_chat_template, history, timer)
            timer.inputs += int(ids.size)
            # a chat's system prompt: its KV cached longest (PagedAttention's priorities)
            if prompt.ids is None:
                messages = history if history is not None else prompt.messages
                self.runner.hold_prefix(system_prompt_tokens(self.tokenizer, messages, ids))
            runner = timer.runner(self.assisted.runner(self.runner, config))
            if beams:  # the static-shape path: the beams take turns in its one sequence
                answers = beams_alone(
                    runner, self.tokenizer, ids, config, streamer,
                    self.constraint(config, timer), limit,
                )  # fmt: skip
                timer.prompt_done(runner, started, answers, detokenizer)
                results += answers
                continue
            answers = generate_sequences(
                runner,
                self.tokenizer,
                ids,
                config,
                streamer=_prompt_streamers(streamer, index, config.num_return_sequences),
                position_limit=limit,
                make_constraint=self.constraint(config, timer),
            )
            self.assisted.finish()  # speculative decoding: drop unused candidates' KV
            timer.prompt_done(runner, started, answers, detokenizer)
            results += answers
        return results

    # -- accounting ---------------------------------------------------------------------------
    def numeric_error(self) -> NumericError:
        """NaN / +inf logits, naming only the settings that would keep the values wider."""
        decided, remedies = self.decided, []
        compute = decided.compute_precision
        if npuw_uses_cpu(decided.npuw_devices):  # NPUW's CPU sub-models
            compute = cpu_precision(self.core, decided.config)
        if decided.npuw_f16:
            remedies.append("set NPUW_F16IC=NO (f32 tensors between NPUW's sub-graphs)")
        if compute != "f32":
            remedies.append("compute in f32 with INFERENCE_PRECISION_HINT=f32")
        if decided.kv_precision not in ("f32", None):
            remedies.append("store KV in f32 with kv_precision='f32'")
        if self.lora is not None and any(self.lora.current):  # the likeliest cause: first
            adapters = self.lora.graph.adapters
            applied = ", ".join(
                f"{getattr(a, 'name', a)}: {alpha:g}"
                for a, alpha in zip(adapters, self.lora.current, strict=True)
                if alpha
            )
            remedies.insert(0, f"lower the LoRA alphas (now {applied})")
        return NumericError.with_remedies(remedies)

    def kv_stats(self) -> dict[str, Any]:
        """KV memory and host-copy accounting of the last request (the running batch's
        scheduler's figures where its prompt was the last); ``max_live_sequences``: how many
        sequences run at once (``max_num_seqs``, or the NPU path's slots; the CPU's static-shape
        path runs one at a time)."""
        live = {"max_live_sequences": self.batch.scheduler.max_num_seqs if self.batch else 1}
        steps = self.batch.scheduler.stats.report() if self.batch is not None else {}
        runner = self.runner
        slots = self.batch.scheduler if self.batch is not None else None
        if isinstance(slots, SlotScheduler) and slots.stats.latest:
            runner = slots.latest  # the slot whose prompt the batch ran last
        return {
            **runner.stats(), **steps, **self.assisted.stats(), **self.batch_stats, **live
        }  # fmt: skip

    def set_kv_window_shares(self, shares: Any) -> None:
        """PagedAttention: split the prefix-cache room and host tier between the window
        pools anew (``kv_window_shares``; None: the default), dropping the cached prefixes.
        Bad shares raise a ``ValueError`` naming the setting, and change nothing."""
        with self.exclusive():
            if not isinstance(self.runner, PagedRunner):
                raise UsageError(
                    f"{label('kv_window_shares')} applies to attention_backend='pa'; this "
                    "pipeline runs the static-shape path, which has no window pools"
                )
            with self.alone():  # the pools are allocated anew
                text = self.runner.set_window_shares(shares, label("kv_window_shares"))
            self.config = replace(self.config, kv_window_shares=text)


def _prompt_streamers(streamer: Any, prompt: int, samples: int) -> Any:
    """Prompt ``prompt``'s streamers out of a call's list (one per answer), or the one."""
    if isinstance(streamer, (list, tuple)):
        return list(streamer[prompt * samples : (prompt + 1) * samples])
    return streamer
