"""A chat's turns go on in the form they started: text (a message history) or token ids.

openvino-genai's stateful chat takes a turn given as token ids as the tokens after the chat's
last answer: the model continues from what it holds.  Here the chat keeps those ids, every turn
and answer so far, and runs them with the new ones; the cache holds most of their KV already
(prefix reuse), so only the new tokens run.  Mixing the two forms in one chat is refused: the
message history does not know the token turns, nor the token history the text turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from ..errors import UsageError
from .inputs import Prompt, Request


def check_turn_kind(
    history: Sequence[dict[str, str]] | None, chat_ids: Sequence[int], text: bool, ids: bool
) -> None:
    """Refuse a turn whose form differs from the chat's earlier turns."""
    said = history is not None and any(m["role"] != "system" for m in history)
    if ids and said:
        raise UsageError(
            "this chat has text turns: give the next turn as text (or finish_chat() and "
            "start_chat() for a chat of token-id turns)"
        )
    if text and chat_ids:
        raise UsageError(
            "this chat has token-id turns: give the next turn as token ids (or finish_chat() "
            "and start_chat() for a chat of text turns)"
        )


def token_turn(request: Request, chat_ids: Sequence[int]) -> Request:
    """The turn's prompt: the chat's ids so far, then the turn's (``check_request`` has
    refused a chat turn of several prompts)."""
    new = request.prompts[0].ids
    assert new is not None
    ids = np.concatenate([np.asarray(chat_ids, np.int64), new.astype(np.int64)])
    return replace(request, prompts=[Prompt(ids=ids)])
