"""Which replica a prompt should go to: the one that served the longest prefix of it, unless
that one is much busier than the least busy.

A replica's block manager keeps the KV of the prompts it served, so the next turn of a chat,
or another request with the same system prompt, runs its prefill only past what is held there;
sent elsewhere it pays for the whole prompt again.  The router cannot see a replica's blocks,
so it remembers what it sent where: each prompt as a chain of hashes over fixed-size pieces of
its text (equal hash ``i`` means equal first ``i + 1`` pieces, as the block manager's block
hashes do with tokens), a bounded, least-recently-used set per replica.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

# npuw-kv's prefix-aware one; Ray Serve's default; and one blind to prefixes that spreads evenly
ROUTERS = ("prefix", "power-of-two", "round-robin")
BLOCK_CHARS = 64  # ~16 tokens of English text: finer than the KV blocks it stands for


def read_json(body: bytes) -> Any:
    """A request body's JSON value (None: empty, or not JSON; the replica says why)."""
    try:
        return json.loads(body) if body else None
    except (ValueError, RecursionError):
        return None


def prompt_text(path: str, body: bytes) -> str:
    """The text a request's prompt starts with (:func:`prompt_of` its body's JSON)."""
    return prompt_of(path, read_json(body))


def prompt_of(path: str, data: Any) -> str:
    """The text a request's prompt starts with, as far as the router cares: chat messages as
    role-tagged text, a completion's (first) prompt; empty for other routes or a body the
    replica will refuse anyway.  ``data``: the body's JSON value."""
    if not isinstance(data, dict):
        return ""
    if path.endswith("/chat/completions"):
        messages = data.get("messages")
        if not isinstance(messages, list):
            return ""
        return "".join(_message_text(m) for m in messages if isinstance(m, dict))
    if path.endswith("/completions"):
        return _prompt_of(data.get("prompt"))
    return ""


def _message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):  # content parts: their text, in order
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return f"<{message.get('role', '')}>{content if isinstance(content, str) else ''}\n"


def _prompt_of(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):  # token ids: matched as text, id by id
            return " ".join(str(t) for t in prompt) + " "
        return _prompt_of(first)  # a batch of prompts: the first one's replica
    return ""


def block_hashes(text: str, block_chars: int = BLOCK_CHARS) -> list[int]:
    """Chain hashes of ``text``'s whole pieces of ``block_chars`` characters (a shorter tail
    is left out, as a partial KV block is not shared)."""
    hashes: list[int] = []
    previous = 0
    for start in range(0, len(text) - block_chars + 1, block_chars):
        previous = hash((previous, text[start : start + block_chars]))
        hashes.append(previous)
    return hashes


class PrefixAffinity:
    """The routing policy, apart from Ray so it can be tested alone.

    A prompt goes to the replica holding the longest run of its leading pieces if that run is
    at least ``min_lead`` pieces longer than the least busy replica's, and that replica has at
    most ``imbalance`` more requests in flight than the least busy one; otherwise to the least
    busy one (among equals, the one holding the fewest pieces, which spreads new
    conversations).  The lead is absolute, not a share of the prompt: the router sees the
    prompts it sent but not the answers, so the next turn of a chat holds a small share of
    pieces the replica knows, yet that replica alone also holds the answer's KV.
    """

    def __init__(
        self,
        *,
        block_chars: int = BLOCK_CHARS,
        blocks_per_replica: int = 100_000,
        imbalance: int = 4,
        min_lead: int = 1,
    ) -> None:
        if min(block_chars, blocks_per_replica, min_lead) < 1 or imbalance < 0:
            raise ValueError(
                "block_chars, blocks_per_replica and min_lead must be >= 1, imbalance >= 0"
            )
        self.block_chars, self.capacity = block_chars, blocks_per_replica
        self.imbalance, self.min_lead = imbalance, min_lead
        self.held: dict[str, OrderedDict[int, None]] = {}

    def record(self, replica: str, text: str) -> None:
        """``replica`` was sent ``text``: it will hold its prefix.  Past ``blocks_per_replica``
        the least recently sent pieces are forgotten first, and of one prompt its last pieces
        first (a run of pieces is only matched from its start, as a block manager evicts the
        leaves of its tree first)."""
        held = self.held.setdefault(replica, OrderedDict())
        for h in reversed(block_hashes(text, self.block_chars)):
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def forget(self, replica: str) -> None:
        """``replica`` is gone (died, or scaled down): what it held is too."""
        self.held.pop(replica, None)

    def matched(self, replica: str, hashes: list[int]) -> int:
        """How many leading pieces of a prompt ``replica`` holds."""
        held = self.held.get(replica)
        if not held:
            return 0
        count = 0
        for h in hashes:
            if h not in held:
                break
            count += 1
        return count

    def rank(self, text: str, loads: Mapping[str, int]) -> list[str]:
        """The replicas in ``loads`` (requests in flight on each), best first."""
        if not loads:
            return []

        def size(r: str) -> int:
            return len(self.held.get(r, ()))

        by_load = sorted(loads, key=lambda r: (loads[r], size(r), r))
        low = loads[by_load[0]]
        eligible = [r for r in by_load if loads[r] <= low + self.imbalance]
        hashes = block_hashes(text, self.block_chars)
        first = by_load[0]
        if hashes:
            best = max(eligible, key=lambda r: (self.matched(r, hashes), -loads[r], -size(r)))
            if self.matched(best, hashes) - self.matched(first, hashes) >= self.min_lead:
                first = best
        return [first] + [r for r in by_load if r != first]
