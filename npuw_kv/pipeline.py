"""``LLMPipeline``: text in, text out, shaped like ``openvino_genai.LLMPipeline``.

Tokenizing, detokenizing, streaming text and chat templates come from openvino-genai's
``Tokenizer`` / ``TextStreamer``; this module adds the generation loop over a runner
(:class:`~npuw_kv.runtime.paged_runner.PagedRunner` or
:class:`~npuw_kv.runtime.static_runner.StaticRunner`) and the stopping rules.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np
import openvino as ov
import openvino_genai

from .config import PipelineConfig
from .decode import GenerationResult, Streamer, generate_tokens
from .errors import ModelLoadError
from .model.source import resolve_model, trained_context
from .model.variants import read_ir
from .runtime.build import build_runner
from .runtime.compile import last_line
from .runtime.heap import fix_mmap_threshold, release_free_heap
from .runtime.runner import Runner
from .sampling import GenerationConfig

T = TypeVar("T")


def _ids(encoded: Any) -> np.ndarray:
    return np.asarray(encoded.input_ids.data, np.int64).reshape(-1)


def _check_text(text: object) -> None:
    """Refuse what no tokenizer can take, before openvino-genai fails on it less clearly."""
    if not isinstance(text, str):
        raise ValueError(f"expected text (str), got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"text is not valid Unicode: {exc.reason} at character {exc.start} "
            f"({text[exc.start : exc.end]!r}); undecodable input bytes end up as such "
            "characters, decode the input as UTF-8 (or with errors='replace') first"
        ) from None


def _tokenize(run: Callable[[], T]) -> T:
    """``run()``, with the tokenizer's own failures as ``ValueError``."""
    try:
        return run()
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"the tokenizer could not take this text: {last_line(exc)}") from exc


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
        self._settings = dict(config)  # as given, for messages
        # one call at a time: the runner, its KV cache and the chat history are one state
        self._lock = threading.Lock()
        self._owner: int | None = None
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
        built = build_runner(self.core, self.model_dir, ir, self.config, kv_capacity, config)
        del ir  # the device holds its own copy of the graph now
        self.runner: Runner = built.runner
        self.config, self.vocab_size, self.layout = built.config, built.vocab_size, built.layout
        self.generation_config = GenerationConfig(eos_token_id=self.tokenizer.get_eos_token_id())
        self._history: list[dict[str, str]] | None = None
        # the graph we prepared and the compiler's temporaries were freed into the C heap, which
        # keeps the pages: give them back (-12 MB peak RSS on SmolLM2)
        release_free_heap()

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Serialize calls from several threads (a second caller waits for the first); a call
        made from inside a running one (e.g. from its streamer) is refused, not deadlocked."""
        me = threading.get_ident()
        if self._owner == me:
            raise RuntimeError(
                "LLMPipeline is already generating on this thread (called from its streamer?); "
                "one pipeline runs one call at a time"
            )
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
        self.generation_config = GenerationConfig.build(config)

    # -- chat ---------------------------------------------------------------------------------
    def start_chat(self, system_message: str = "") -> None:
        with self._exclusive():
            _check_text(system_message)
            self._history = (
                [{"role": "system", "content": system_message}] if system_message else []
            )

    def finish_chat(self) -> None:
        with self._exclusive():
            self._history = None

    def fit_chat_history(self, prompt: str) -> int:
        """Make room for ``prompt`` as the next user turn: when the chat would outgrow
        MAX_PROMPT_LEN, drop the oldest user/assistant exchanges (the system message stays)
        down to half of it.  Returns how many exchanges were dropped.

        A long chat would otherwise end in a capacity error that costs the user's message (or
        the whole history).  Dropping only what the next turn needs would change the tokens
        after the system message on every turn from then on, and with them every cached KV
        entry after it; dropping down to half keeps the history a stable prefix for the next
        turns, which then reuse its KV and run only their own tokens.  When half is not
        reachable the fewest exchanges that make the prompt fit are dropped.  If the prompt
        does not fit even alone, the history is left as it was and :meth:`generate` raises the
        usual error naming the setting.
        """
        with self._exclusive():
            if self._history is None:
                raise ValueError("fit_chat_history needs chat mode: call start_chat() first")
            limit = self.config.max_prompt_len  # never above the trained context (checked)
            system = [m for m in self._history[:1] if m["role"] == "system"]
            turns = self._history[len(system) :]
            user = {"role": "user", "content": prompt}
            if self._template_ids([*self._history, user]).size <= limit:
                return 0
            fits = None
            for dropped in range(1, len(turns) // 2 + 1):
                kept = system + turns[2 * dropped :]  # an exchange: a user message, its answer
                size = self._template_ids([*kept, user]).size
                if fits is None and size <= limit:
                    fits = dropped
                if size <= limit // 2:
                    fits = dropped
                    break
            if fits is not None:
                self._history = system + turns[2 * fits :]
            return fits or 0

    # -- generation ---------------------------------------------------------------------------
    def encode(self, prompt: str, chat: bool = False, template: bool = True) -> np.ndarray:
        """Token ids of ``prompt``: as a user turn through the chat template (with the chat
        history when ``chat``), or as raw text when ``template`` is off or there is none."""
        if chat or (template and self.tokenizer.chat_template):
            earlier = list(self._history or []) if chat else []
            return self._template_ids([*earlier, {"role": "user", "content": prompt}])
        _check_text(prompt)
        return _tokenize(lambda: _ids(self.tokenizer.encode(prompt)))

    def _template_ids(self, messages: list[dict[str, str]]) -> np.ndarray:
        for message in messages:
            _check_text(message["content"])

        def run() -> np.ndarray:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            return _ids(self.tokenizer.encode(text, add_special_tokens=False))

        return _tokenize(run)

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
        with self._exclusive():
            config = GenerationConfig.build(generation_config or self.generation_config, **kwargs)
            if config.eos_token_id is None or config.eos_token_id < 0:  # genai's unset is -1
                config.eos_token_id = self.tokenizer.get_eos_token_id()
            chat = self._history is not None and isinstance(inputs, str)
            if isinstance(inputs, str):
                ids = self.encode(inputs, chat=chat, template=config.apply_chat_template)
            else:
                ids = self._token_ids(inputs)
            limit = self.trained_context[0] if self.trained_context else None
            result = generate_tokens(self.runner, self.tokenizer, ids, config, streamer, limit)
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
        if array.dtype == object and all(isinstance(i, int) for i in array.flat):
            bad = [i for i in array.flat if not 0 <= i < self.vocab_size]  # beyond 64 bits
            if bad:
                raise ValueError(
                    f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
                )
            array = array.astype(np.int64)
        if array.size and not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"token ids must be integers, got {array.dtype} values")
        # checked before the cast, which would wrap ids of 2**63 and above
        outside = array[(array < 0) | (array >= self.vocab_size)]
        if outside.size:
            raise ValueError(
                f"token id {int(outside.flat[0])} is outside the vocabulary [0, {self.vocab_size})"
            )
        return array.astype(np.int64).reshape(-1)

    # -- accounting ---------------------------------------------------------------------------
    def kv_stats(self) -> dict[str, Any]:
        """KV memory and host-copy accounting of the last request."""
        return self.runner.stats()
