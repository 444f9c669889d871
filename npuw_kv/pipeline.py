"""``LLMPipeline``: text in, text out, shaped like ``openvino_genai.LLMPipeline``.

Tokenizing, detokenizing, streaming text and chat templates come from openvino-genai's
``Tokenizer`` / ``TextStreamer``; this module adds the generation loop over a runner
(:class:`~npuw_kv.runtime.paged.PagedRunner` or :class:`~npuw_kv.runtime.engine.StaticRunner`)
and the stopping rules.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np
import openvino as ov
import openvino_genai

from .config import STORE_BLOCK_TOKENS, PipelineConfig
from .model.paged import make_paged, split_block_tables
from .model.source import declared_window, resolve_model, trained_context
from .model.variants import ModelLoadError, StaticShapes, prepare, read_ir
from .runtime.compile import (
    CompileError,
    compile_paged,
    compile_requests,
    last_line,
    resolve_kv_precision,
)
from .runtime.engine import StaticRunner
from .runtime.heap import fix_mmap_threshold, release_free_heap
from .runtime.paged import PagedRunner
from .sampling import GenerationConfig, Sampler
from .stopping import StopStrings, TextSink

T = TypeVar("T")

# a callable taking text (wrapped in openvino-genai's TextStreamer) or a token-level
# openvino_genai.StreamerBase; either may return None, a bool or a StreamingStatus
Streamer = Any


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    finish_reason: str  # "stop" (EOS / stop string / streamer), "length", "cancelled"
    prompt_tokens: int
    ttft_s: float = 0.0
    decode_s: float = 0.0
    first_logits: np.ndarray | None = field(default=None, repr=False)

    @property
    def ms_per_token(self) -> float:
        steps = max(len(self.tokens) - 1, 1)
        return 1000.0 * self.decode_s / steps

    def __str__(self) -> str:
        return self.text


def _ids(encoded: Any) -> np.ndarray:
    return np.asarray(encoded.input_ids.data, np.int64).reshape(-1)


# what a streamer may return to end generation early (``CANCEL`` also drops the chat turn)
_STOPS = (
    openvino_genai.StreamingStatus.STOP,
    openvino_genai.StreamingStatus.TOOL_CALL_STOP,
    True,
)


def _vocab(logits: ov.Output) -> int:
    return int(logits.get_partial_shape()[-1].get_length())


class LLMPipeline:
    """LLM pipeline on one KV cache that prefill and generate share in place.

    On CPU attention runs as the plugin's PagedAttention over our paged cache by default; the
    NPU path (and CPU with ``attention_backend="sdpa"``) runs static prefill/generate shapes
    over one buffer per layer through ROI views.

    ``model``: an IR directory, a ``.gguf`` file, or None / "smollm2" for the shipped default.
    ``config``: :class:`~npuw_kv.config.PipelineConfig` fields or their NPUW names.
    """

    def __init__(
        self, model: str | os.PathLike[str] | None = None, device: str = "CPU", **config: Any
    ) -> None:
        self.config = PipelineConfig.from_kwargs(device, **config)
        fix_mmap_threshold()  # before compiling: see runtime/heap.py for what it keeps flat
        self.model_dir = resolve_model(model, zero_points=self.config.gguf_zero_points)
        # (positions, where it was read); generation never goes past it
        self.trained_context = trained_context(self.model_dir)
        kv_capacity = self.config.kv_capacity(self.trained_context)
        self.core = ov.Core()
        ir = read_ir(self.core, self.model_dir)
        try:  # before compiling: a broken tokenizer should not cost a compile first
            self.tokenizer = openvino_genai.Tokenizer(str(self.model_dir))
        except RuntimeError as exc:
            raise ModelLoadError(
                f"cannot load the tokenizer IRs in {self.model_dir} ({last_line(exc)})"
            ) from exc
        self.shapes = StaticShapes(
            self.config.prefill_chunk_size, self.config.max_prompt_len, kv_capacity
        )
        self.runner = self._runner(ir, kv_capacity)
        del ir  # the device holds its own copy of the graph now
        self.generation_config = GenerationConfig(eos_token_id=self.tokenizer.get_eos_token_id())
        self._history: list[dict[str, str]] | None = None
        # the graph we prepared and the compiler's temporaries were freed into the C heap, which
        # keeps the pages: give them back (-12 MB peak RSS on SmolLM2)
        release_free_heap()

    def _runner(self, ir: ov.Model, kv_capacity: int) -> StaticRunner | PagedRunner:
        """Rewrite ``ir`` (in place) for the attention backend, compile it, bind the KV cache.

        ``auto`` falls back to the static-shape path, with a warning, when the CPU plugin
        cannot compile PagedAttention with these settings (e.g. a CPU it has no kernel for).
        """
        config = self.config
        if config.paged:
            paged = make_paged(ir, config.full_prefill_logits)
            windows = split_block_tables(paged, kv_capacity)
            try:
                request = self._compile(lambda: compile_paged(self.core, paged, config))
            except CompileError as exc:
                if config.attention_backend != "auto":
                    raise
                room = config.prefix_cache_tokens
                warnings.warn(
                    f"PagedAttention did not compile ({exc}); running the static-shape path "
                    "(attention_backend='sdpa')"
                    + (", where prefix_cache_tokens is a host store" if room else ""),
                    RuntimeWarning,
                    stacklevel=3,
                )
                ir = read_ir(self.core, self.model_dir)  # the rewrite above was in place
                # a room too small for one block of the host store is dropped, not refused
                self.config = config = replace(
                    config,
                    attention_backend="sdpa",
                    prefix_cache_tokens=room if room >= STORE_BLOCK_TOKENS else 0,
                )
            else:
                self.vocab_size = _vocab(request.get_compiled_model().output("logits"))
                return self._allocate(
                    kv_capacity + config.prefix_cache_tokens,
                    lambda: PagedRunner(
                        request,
                        kv_capacity,
                        config.max_prompt_len,
                        config.prefill_chunk_size,
                        config.prefix_reuse,
                        config.prefix_cache_tokens,
                        windows,
                    ),
                )
        prepared, layout = prepare(
            ir,
            resolve_kv_precision(self.core, config),
            config.full_prefill_logits,
            declared_window(self.model_dir, kv_capacity),
        )
        self.layout = layout
        requests = self._compile(
            lambda: compile_requests(self.core, prepared, layout, config, self.shapes)
        )
        self.vocab_size = _vocab(
            requests.prefill.get_compiled_model().outputs[layout.logits_output_index]
        )
        return self._allocate(
            kv_capacity,
            lambda: StaticRunner(
                requests,
                layout,
                self.shapes,
                config.kv_binding,
                config.prefix_reuse,
                config.prefix_cache_tokens,
            ),
        )

    def _compile(self, compile_: Callable[[], T]) -> T:
        try:
            return compile_()
        except RuntimeError as exc:
            raise CompileError(
                f"{self.config.device} could not compile the model with these settings "
                f"{self.config.compile_properties or '(defaults)'}: {last_line(exc)}"
            ) from exc

    @staticmethod
    def _allocate(kv_capacity: int, build: Callable[[], T]) -> T:
        try:
            return build()
        except MemoryError as exc:
            raise ValueError(
                f"cannot allocate a KV cache of {kv_capacity} tokens; lower "
                "max_prompt_len (MAX_PROMPT_LEN), min_response_len (MIN_RESPONSE_LEN) or "
                "prefix_cache_tokens (PREFIX_CACHE_TOKENS)"
            ) from exc

    # -- genai-shaped accessors -------------------------------------------------------------
    def get_tokenizer(self) -> openvino_genai.Tokenizer:
        return self.tokenizer

    def get_generation_config(self) -> GenerationConfig:
        return GenerationConfig.build(self.generation_config)

    def set_generation_config(self, config: GenerationConfig) -> None:
        self.generation_config = GenerationConfig.build(config)

    # -- chat ---------------------------------------------------------------------------------
    def start_chat(self, system_message: str = "") -> None:
        self._history = [{"role": "system", "content": system_message}] if system_message else []

    def finish_chat(self) -> None:
        self._history = None

    def fit_chat_history(self, prompt: str) -> int:
        """Drop the oldest user/assistant exchanges until ``prompt`` as the next user turn fits
        MAX_PROMPT_LEN; the system message stays.  Returns how many exchanges were dropped.

        A long chat would otherwise end in a capacity error that costs the user's message (or
        the whole history).  If the prompt does not fit even alone, the history is left as it
        was and :meth:`generate` raises the usual error naming the setting.
        """
        if self._history is None:
            raise ValueError("fit_chat_history needs chat mode: call start_chat() first")
        limit = self.config.max_prompt_len  # never above the trained context (checked at init)
        system = [m for m in self._history[:1] if m["role"] == "system"]
        turns = self._history[len(system) :]
        user = {"role": "user", "content": prompt}
        for dropped in range(0, len(turns) // 2 + 1):
            kept = system + turns[2 * dropped :]  # one exchange = a user message and its answer
            if self._template_ids([*kept, user]).size <= limit:
                self._history = kept
                return dropped
        return 0

    # -- generation ---------------------------------------------------------------------------
    def encode(self, prompt: str, chat: bool = False, template: bool = True) -> np.ndarray:
        """Token ids of ``prompt``: as a user turn through the chat template (with the chat
        history when ``chat``), or as raw text when ``template`` is off or there is none."""
        if chat or (template and self.tokenizer.chat_template):
            earlier = list(self._history or []) if chat else []
            return self._template_ids([*earlier, {"role": "user", "content": prompt}])
        return _ids(self.tokenizer.encode(prompt))

    def _template_ids(self, messages: list[dict[str, str]]) -> np.ndarray:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return _ids(self.tokenizer.encode(text, add_special_tokens=False))

    def generate(
        self,
        inputs: str | Sequence[int] | np.ndarray | ov.Tensor,
        generation_config: GenerationConfig | None = None,
        streamer: Streamer | None = None,
        **kwargs: Any,
    ) -> GenerationResult:
        """Generate a continuation of ``inputs`` (text, or token ids).

        In chat mode (after :meth:`start_chat`) a text input is a user turn: the history goes
        through the model's chat template and the answer is appended to the history (unless the
        streamer cancelled the turn, as in openvino-genai).
        """
        config = GenerationConfig.build(generation_config or self.generation_config, **kwargs)
        if config.eos_token_id is None or config.eos_token_id < 0:  # genai's "unset" is -1
            config.eos_token_id = self.tokenizer.get_eos_token_id()
        chat = self._history is not None and isinstance(inputs, str)
        if isinstance(inputs, str):
            ids = self.encode(inputs, chat=chat, template=config.apply_chat_template)
        else:
            ids = self._token_ids(inputs)
        result = self._generate_ids(ids, config, streamer)
        if chat and self._history is not None and result.finish_reason != "cancelled":
            self._history += [
                {"role": "user", "content": str(inputs)},
                {"role": "assistant", "content": result.text},
            ]
        return result

    def _token_ids(self, inputs: Any) -> np.ndarray:
        """One prompt's token ids from a list, array, ``ov.Tensor`` or genai TokenizedInputs."""
        if hasattr(inputs, "input_ids"):  # openvino_genai.TokenizedInputs
            inputs = inputs.input_ids
        array = np.asarray(inputs.data if isinstance(inputs, ov.Tensor) else inputs)
        if array.ndim == 0:
            raise ValueError(f"expected text or a sequence of token ids, got {inputs!r}")
        if array.ndim > 2 or (array.ndim == 2 and array.shape[0] != 1):
            raise ValueError(
                f"token ids of shape {list(array.shape)}: one prompt at a time (batch size 1)"
            )
        if array.size and not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"token ids must be integers, got {array.dtype} values")
        ids = array.astype(np.int64).reshape(-1)
        outside = ids[(ids < 0) | (ids >= self.vocab_size)]
        if outside.size:
            raise ValueError(
                f"token id {int(outside[0])} is outside the vocabulary [0, {self.vocab_size})"
            )
        return ids

    def _token_streamer(self, streamer: Streamer) -> tuple[Any, TextSink | None]:
        """A token-level streamer (``write(token)``, ``end()``) for ``streamer``, and for a
        text callable the sink that feeds it."""
        if streamer is None or isinstance(streamer, openvino_genai.StreamerBase):
            return streamer, None
        if not callable(streamer):
            raise ValueError(
                "streamer must be a callable taking text or an openvino_genai.StreamerBase, "
                f"got {type(streamer).__name__}"
            )
        sink = TextSink(streamer)
        return openvino_genai.TextStreamer(self.tokenizer, sink), sink

    def _generate_ids(
        self, ids: np.ndarray, config: GenerationConfig, streamer: Streamer
    ) -> GenerationResult:
        sampler = Sampler(config, ids)
        token_streamer, sink = self._token_streamer(streamer)
        stops = StopStrings(self.tokenizer, config.stop_strings)
        eos = None if config.ignore_eos else config.eos_token_id
        start = time.perf_counter()
        logits = self.runner.prefill(ids)
        first_logits = logits
        tokens: list[int] = []
        streamed = 0  # tokens handed to the streamer; it lags by stops.hold (see StopStrings)
        halted: str | None = None  # set when the streamer itself stopped or cancelled the run
        finish = "length"
        ttft = decode_start = time.perf_counter() - start

        def stream(upto: int) -> str | None:
            nonlocal streamed
            while token_streamer is not None and streamed < upto:
                status = token_streamer.write(tokens[streamed])
                streamed += 1
                if status == openvino_genai.StreamingStatus.CANCEL:
                    return "cancelled"
                if status in _STOPS:
                    return "stop"
            return None

        while len(tokens) < config.max_new_tokens:
            token = sampler(logits)
            if not tokens:
                ttft = decode_start = time.perf_counter() - start
            if token == eos:
                finish = "stop"
                break
            tokens.append(token)
            if stops.hit(tokens):
                finish = "stop"
                break
            halted = stream(len(tokens) - stops.hold)
            if halted:
                finish = halted
                break  # the streamer said stop: it gets nothing more
            if len(tokens) >= config.max_new_tokens:
                break
            if self.runner.remaining_capacity <= 0 or self._at_trained_context(
                ids.size + len(tokens)
            ):
                finish = "length"
                break
            logits = self.runner.step(token)
        text, kept = stops.cut(tokens)
        if not halted:
            halted = stream(kept)  # what the stop-string hold-back kept
            if halted == "cancelled":
                finish = "cancelled"
        if token_streamer is not None and finish != "cancelled":
            token_streamer.end()  # flush held-back text; a cancelled run wants no more calls
            if sink is not None and not halted:  # a streamer that said stop gets no more
                sink.finish(text)  # a token's text before a stop string that starts inside it
        decode_s = time.perf_counter() - start - decode_start
        return GenerationResult(
            tokens[:kept], text, finish, int(ids.size), ttft, decode_s, first_logits
        )

    def _at_trained_context(self, positions: int) -> bool:
        """True when ``positions`` tokens fill the model's trained context (no more steps)."""
        return self.trained_context is not None and positions >= self.trained_context[0]

    # -- accounting ---------------------------------------------------------------------------
    def kv_stats(self) -> dict[str, Any]:
        """KV memory and host-copy accounting of the last request."""
        runner = self.runner
        return {
            "kv_bytes_allocated": runner.cache.bytes_allocated,
            "kv_capacity_tokens": runner.cache.capacity,
            "kv_bytes_per_token": runner.cache.bytes_per_token(),
            "kv_precision": runner.cache.precision,
            "tokens_in_cache": runner.tokens_in_cache,
            "reused_tokens": runner.reused_tokens,
            "cached_tokens": runner.cached_tokens,
            "kv_binding": runner.kv_binding,
            "shared_weights": runner.shared_weights,
            "host_bytes_copied": runner.host_bytes_copied,
            "prefill_host_bytes_copied": runner.prefill_copied_bytes,
            "switch_host_bytes_copied": runner.switch_copied_bytes,
        }
