"""The prompts of a :meth:`~npuw_kv.pipeline.LLMPipeline.generate` call, in openvino-genai's
forms (text, lists of text, chats, token ids, ``ov.Tensor`` / ``TokenizedInputs``), made uniform
(:func:`read_inputs`) and checked against the generation settings (:func:`check_request`).
The constructor's forms are :mod:`.pipeline_args`'.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import openvino as ov
import openvino_genai

from ..errors import UsageError


@dataclass
class Prompt:
    """One prompt: text (a user turn, or raw text), a chat (messages, with the tools and
    extra context the chat template gets), or token ids."""

    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[Any] | None = None
    extra_context: dict[str, Any] | None = None
    ids: np.ndarray | None = None


@dataclass
class Request:
    """``kind`` says what comes back: "text" (one str prompt), "texts" (a list of them),
    "chat" (a ChatHistory or messages), "ids" (one prompt's ids as a list or array),
    "encoded" (``ov.Tensor`` / ``TokenizedInputs``, one prompt per row)."""

    kind: str
    prompts: list[Prompt] = field(default_factory=list)


def read_inputs(inputs: Any, vocab_size: int) -> Request:
    """The prompts of ``inputs``; anything else is a ``ValueError`` saying what was wrong."""
    if isinstance(inputs, str):
        return Request("text", [Prompt(text=inputs)])
    if isinstance(inputs, openvino_genai.ChatHistory):
        return Request(
            "chat",
            [
                Prompt(
                    messages=_messages(inputs.get_messages()),
                    tools=list(inputs.get_tools()) or None,
                    extra_context=dict(inputs.get_extra_context()) or None,
                )
            ],
        )
    if isinstance(inputs, openvino_genai.TokenizedInputs):
        return Request("encoded", _rows(inputs.input_ids, inputs.attention_mask, vocab_size))
    if isinstance(inputs, ov.Tensor):
        return Request("encoded", _rows(inputs, None, vocab_size))
    if isinstance(inputs, (list, tuple)):
        if not inputs:
            raise UsageError(
                "empty input: give a prompt, a list of prompts, chat messages or token ids"
            )
        if all(isinstance(item, str) for item in inputs):
            return Request("texts", [Prompt(text=item) for item in inputs])
        if all(isinstance(item, Mapping) for item in inputs):
            return Request("chat", [Prompt(messages=_messages(inputs))])
        if any(isinstance(item, (str, Mapping)) for item in inputs):
            kinds = sorted({type(item).__name__ for item in inputs})
            raise UsageError(
                f"a list of {', '.join(kinds)}: give all prompts (str), all chat messages "
                "(dicts with role and content), or all token ids (int)"
            )
    return Request("ids", [Prompt(ids=token_ids(inputs, vocab_size))])


def _messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Chat messages checked: dicts with a string ``role``; ``content``, when given, text."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise UsageError(
                f"chat message {i} must be a dict with a 'role' (and 'content'), got {message!r}"
            )
        content = message.get("content", "")
        if not isinstance(content, str):
            raise UsageError(
                f"chat message {i}: content must be text (str), got {type(content).__name__}"
            )
        out.append(dict(message))
    if not out:
        raise UsageError("an empty chat history: add a message first")
    return out


def _rows(ids: ov.Tensor, mask: ov.Tensor | None, vocab_size: int) -> list[Prompt]:
    """One prompt per row of ``[B, S]`` ids; ``mask`` (1 = token) drops the padding, on
    whichever side it is."""
    array = np.asarray(ids.data)
    if array.ndim == 1:
        array = array[None]
    if array.ndim != 2 or array.shape[0] == 0:
        raise UsageError(f"token ids of shape {list(array.shape)}: expected [batch, length]")
    keep = np.ones(array.shape, bool)
    if mask is not None:
        keep = np.asarray(mask.data)
        if keep.shape != array.shape:
            raise UsageError(
                f"attention_mask of shape {list(keep.shape)} does not match input_ids "
                f"{list(array.shape)}"
            )
        keep = keep != 0
    return [
        Prompt(ids=token_ids(row[kept], vocab_size)) for row, kept in zip(array, keep, strict=True)
    ]


def token_ids(inputs: Any, vocab_size: int) -> np.ndarray:
    """One prompt's token ids from a list, array or ``[1, N]`` tensor."""
    array = np.asarray(inputs.data if isinstance(inputs, ov.Tensor) else inputs)
    if array.ndim == 0:
        raise UsageError(f"expected text or a sequence of token ids, got {inputs!r}")
    if array.ndim > 2 or (array.ndim == 2 and array.shape[0] != 1):
        raise UsageError(
            f"token ids of shape {list(array.shape)}: one prompt at a time (batch size 1); "
            "a batch goes in as an ov.Tensor or TokenizedInputs"
        )
    if array.dtype == object and all(isinstance(i, int) for i in array.flat):
        bad = [i for i in array.flat if not 0 <= i < vocab_size]  # beyond 64 bits
        if bad:
            raise UsageError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        array = array.astype(np.int64)
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise UsageError(f"token ids must be integers, got {array.dtype} values")
    # checked before the cast, which would wrap ids of 2**63 and above
    outside = array[(array < 0) | (array >= vocab_size)]
    if outside.size:
        raise UsageError(
            f"token id {int(outside.flat[0])} is outside the vocabulary [0, {vocab_size})"
        )
    return array.astype(np.int64).reshape(-1)


# the most sequences one call may ask for (each is held, and run, until the call ends)
MAX_SEQUENCES = 1024


def check_request(request: Request, config: Any, streamer: Any, chatting: bool) -> None:
    """Refuse what a request cannot mean, before any work (``num_return_sequences`` itself is
    checked by the GenerationConfig)."""
    repeats = config.num_return_sequences
    if repeats > 1 and request.kind == "ids":
        raise UsageError(
            "num_return_sequences > 1 returns several token lists: pass the ids as an ov.Tensor "
            "(EncodedResults) instead of a list or array"
        )
    if chatting and request.kind in ("texts", "encoded") and len(request.prompts) > 1:
        raise UsageError(
            f"chat mode (start_chat) takes one prompt at a time, got {len(request.prompts)}"
        )
    if request.kind == "chat" and not config.apply_chat_template:
        raise UsageError(
            "a chat history goes through the chat template: not with apply_chat_template=False"
        )
    answers = len(request.prompts) * repeats
    sequences = len(request.prompts) * max(repeats, config.num_beams)
    if sequences > MAX_SEQUENCES:
        raise UsageError(
            f"{len(request.prompts)} prompt(s) x {max(repeats, config.num_beams)} "
            f"(num_return_sequences / num_beams) = {sequences} sequences in one call; at most "
            f"{MAX_SEQUENCES}: split the call"
        )
    if isinstance(streamer, (list, tuple)):
        if len(streamer) != answers or config.num_beams > 1:
            raise UsageError(
                f"a list of streamers takes one streamer per answer: {len(request.prompts)} "
                f"prompt(s) x num_return_sequences={repeats} = {answers}, got {len(streamer)}"
                + (" (beam search takes none)" if config.num_beams > 1 else "")
            )
    elif streamer is not None and answers > 1:
        raise UsageError(
            "a streamer takes one answer: give one prompt and num_return_sequences=1, or a "
            f"list of {answers} streamers (got {len(request.prompts)} prompt(s) x {repeats})"
        )
