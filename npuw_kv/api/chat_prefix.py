"""How many of a chat prompt's tokens are its system prompt, to keep their KV cached longest.

On PagedAttention a chat's system prompt is the prefix every later turn (and every chat with
the same system message) starts with; the block manager evicts by priority, so the pipeline
tells the runner how many leading tokens to hold at a high one (``Runner.hold_prefix``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def system_prompt_tokens(
    tokenizer: Any, messages: Sequence[dict[str, Any]] | None, ids: np.ndarray
) -> int:
    """Leading tokens of ``ids`` (the templated ``messages``) that the system message alone
    templates to; 0 when the chat has no system message, or when the template refuses a chat
    of the system message alone (some insist on a user turn): holding it is only a speed-up."""
    if not messages or messages[0].get("role") != "system":
        return 0
    try:
        text = tokenizer.apply_chat_template(list(messages[:1]), add_generation_prompt=False)
    except RuntimeError:
        return 0
    head = np.asarray(tokenizer.encode(text, add_special_tokens=False).input_ids.data).reshape(-1)
    ids = np.asarray(ids).reshape(-1)
    n = min(head.size, ids.size)
    differ = np.flatnonzero(head[:n] != ids[:n])
    return int(differ[0]) if differ.size else n
