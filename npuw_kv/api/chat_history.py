"""Which old exchanges of a chat to drop so the next user turn fits MAX_PROMPT_LEN.

A long chat would otherwise end in a capacity error that costs the user's message (or the whole
history).  Dropping only what the next turn needs would change the tokens after the system
message on every turn from then on, and with them every cached KV entry after it; dropping down
to half of the limit keeps the history a stable prefix for the next turns, which then reuse its
KV and run only their own tokens.  When half is not reachable the fewest exchanges that make the
prompt fit are dropped; when the prompt does not fit even alone, nothing is.
"""

from __future__ import annotations

from collections.abc import Callable

Message = dict[str, str]


def fit_history(
    history: list[Message], prompt: str, count: Callable[[list[Message]], int], limit: int
) -> tuple[list[Message], int]:
    """``history`` with the oldest user/assistant exchanges dropped (the system message stays)
    so that ``prompt`` fits as the next user turn, and how many were dropped.

    ``count(messages)``: the token count of ``messages`` through the chat template.
    """
    system = [m for m in history[:1] if m["role"] == "system"]
    turns = history[len(system) :]
    user = {"role": "user", "content": prompt}
    if count([*history, user]) <= limit:
        return history, 0
    fits = None
    for dropped in range(1, len(turns) // 2 + 1):
        kept = system + turns[2 * dropped :]  # an exchange: a user message, its answer
        size = count([*kept, user])
        if fits is None and size <= limit:
            fits = dropped
        if size <= limit // 2:
            fits = dropped
            break
    if fits is None:
        return history, 0
    return system + turns[2 * fits :], fits
