"""Any prompt to token ids, in one call (:meth:`PromptEncoder.ids`): openvino-genai's
tokenizer and the model's chat template.

Text a tokenizer cannot take is refused with a ``ValueError`` that says why, before
openvino-genai fails on it less clearly, and the tokenizer's own failures become
``ValueError`` too; a chat template that fails keeps its own message (a template's
``raise_exception('...')`` text).  The time spent is recorded in genai's ``PerfMetrics`` spans.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import openvino_genai

from ..errors import ModelLoadError, UsageError, last_line
from ..model.gguf_tokenizer import template_message
from ..model.tokenizer_ir import untruncated_tokenizer
from .inputs import Prompt
from .perf_metrics import CallTimer

T = TypeVar("T")


def load_tokenizer(
    model_dir: Path, properties: Mapping[Any, Any] | None = None
) -> openvino_genai.Tokenizer:
    """openvino-genai's tokenizer of a model directory, without the length cut its IR bakes
    in (:mod:`npuw_kv.model.tokenizer_ir`: no prompt is cut silently); IRs that do not load
    raise a ``ModelLoadError`` naming the directory.  ``properties``: what its IRs are
    compiled with (genai's ``tokenizer_properties``)."""
    props = {str(key): value for key, value in (properties or {}).items()}
    try:
        tokenizer = openvino_genai.Tokenizer(str(model_dir), **props)
    except RuntimeError as exc:
        raise ModelLoadError(
            f"cannot load the tokenizer IRs in {model_dir} ({last_line(exc)})"
        ) from exc
    whole = untruncated_tokenizer(model_dir, tokenizer, props)
    return tokenizer if whole is None else whole


def _ids(encoded: Any) -> np.ndarray:
    return np.asarray(encoded.input_ids.data, np.int64).reshape(-1)


def check_text(text: object) -> None:
    """Refuse what no tokenizer can take, before openvino-genai fails on it less clearly."""
    if not isinstance(text, str):
        raise UsageError(f"expected text (str), got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UsageError(
            f"text is not valid Unicode: {exc.reason} at character {exc.start} "
            f"({text[exc.start : exc.end]!r}); undecodable input bytes end up as such "
            "characters, decode the input as UTF-8 (or with errors='replace') first"
        ) from None


def _tokenize(run: Callable[[], T]) -> T:
    """``run()``, with the tokenizer's own failures as ``ValueError``."""
    try:
        return run()
    except UsageError:  # already says what failed (a chat template's own message)
        raise
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"the tokenizer could not take this text: {last_line(exc)}") from exc


def _template(run: Callable[[], T]) -> T:
    """``run()``, with a failing chat template's own message (not only the caret line under
    the failing spot, which ends openvino-genai's error) in the ``ValueError``."""
    try:
        return run()
    except RuntimeError as exc:
        raise UsageError(f"the chat template failed: {template_message(exc)}") from exc


def _span(timer: CallTimer | None, key: str) -> AbstractContextManager[None]:
    return timer.span(key) if timer else nullcontext()


class PromptEncoder:
    """Token ids of a prompt given as text, as chat messages or as ids."""

    def __init__(self, tokenizer: openvino_genai.Tokenizer) -> None:
        self.tokenizer = tokenizer

    def ids(
        self,
        prompt: Prompt,
        template: bool = True,
        history: list[dict[str, Any]] | None = None,
        timer: CallTimer | None = None,
    ) -> np.ndarray:
        """``prompt``'s token ids: ids as given; a chat's messages through the chat template;
        text as the next user turn after ``history`` (chat mode: always templated), through
        the template when ``template`` is on and the model has one, else as raw text."""
        if prompt.ids is not None:
            return prompt.ids
        if prompt.messages is not None:
            return self.messages(prompt.messages, prompt.tools, prompt.extra_context, timer)
        assert prompt.text is not None
        if history is not None or (template and self.tokenizer.chat_template):
            turn = {"role": "user", "content": prompt.text}
            return self.messages([*(history or []), turn], timer=timer)
        return self.text(prompt.text, timer)

    def text(self, prompt: str, timer: CallTimer | None = None) -> np.ndarray:
        """``prompt`` as raw text (the tokenizer adds its special tokens, e.g. BOS)."""
        check_text(prompt)
        with _span(timer, "tokenization_durations"):
            return _tokenize(lambda: _ids(self.tokenizer.encode(prompt)))

    def messages(
        self,
        messages: list[dict[str, Any]],
        tools: list[Any] | None = None,
        extra_context: dict[str, Any] | None = None,
        timer: CallTimer | None = None,
    ) -> np.ndarray:
        """``messages`` through the chat template, ready for the assistant's turn."""
        for message in messages:
            check_text(message.get("content", ""))

        def apply() -> str:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tools=tools, extra_context=extra_context
            )

        with _span(timer, "chat_template_durations"):
            text = _tokenize(lambda: _template(apply))
        with _span(timer, "tokenization_durations"):
            return _tokenize(lambda: _ids(self.tokenizer.encode(text, add_special_tokens=False)))
