"""What the pipeline asks of a runner, whichever attention backend it drives.

A runner owns the compiled model(s), the KV cache and which tokens it holds; it takes token ids
and returns logits (text is the pipeline's).  :class:`~.static_runner.StaticRunner` runs the
static-shape prefill/generate pair over one shared buffer per layer;
:class:`~.paged_runner.PagedRunner` runs the CPU plugin's PagedAttention over a paged cache.
Both report the same accounting through :meth:`Runner.stats`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from ..errors import CapacityError, UsageError


class CacheInfo(Protocol):
    """What the accounting reads of a KV cache (shared buffers or paged blocks)."""

    capacity: int
    precision: str

    @property
    def bytes_allocated(self) -> int: ...

    def bytes_per_token(self) -> int: ...


SPECULATIVE_PATH = (
    "prompt_lookup and draft_model need the PagedAttention path (the CPU default, "
    "attention_backend='pa'); the static-shape path (NPU, attention_backend='sdpa') runs "
    "logits for one token per call"
)

# on_chunk(positions, logits): the logits rows of each prefill call and their positions
ChunkHook = Callable[[np.ndarray, np.ndarray], None]


class Runner(ABC):
    """Prefill a prompt, step one token at a time, and say what the KV cache holds."""

    cache: CacheInfo
    chunk: int  # prompt tokens one prefill call runs at most
    max_prompt_len: int  # the longest prompt it takes (MAX_PROMPT_LEN)
    kv_binding: str  # "roi" / "copy" (static shapes) or "paged"
    reused_tokens: int  # of the last prompt, taken from the cache instead of run
    # of the KV bytes the host copied (host_bytes_copied): during the last prompt, and at
    # the prefill -> generate switch (0 by design)
    prefill_copied_bytes: int
    switch_copied_bytes: int
    takes_trees: bool = False  # verify(tokens, parents) checks a tree of candidates

    def check_prompt(self, tokens: int) -> None:
        """Refuse a prompt of ``tokens`` tokens this runner cannot take (empty, or longer than
        MAX_PROMPT_LEN), naming the setting; every path's one check."""
        if tokens <= 0:
            raise UsageError("prompt is empty: at least one token is needed")
        if tokens > self.max_prompt_len:
            raise CapacityError.prompt(tokens, self.max_prompt_len)

    @abstractmethod
    def prefill(self, ids: np.ndarray, on_chunk: ChunkHook | None = None) -> np.ndarray:
        """Run the prompt ``ids`` (after whatever prefix the cache holds); the last logits."""

    @abstractmethod
    def step(self, token: int) -> np.ndarray:
        """Feed one generated token; the next logits."""

    def prefill_every_row(self, ids: np.ndarray, on_rows: ChunkHook) -> np.ndarray:
        """:meth:`prefill` with every prompt row's logits handed to ``on_rows`` (a prompt's
        own log-probabilities); the last logits."""
        return self.prefill(ids, on_rows)

    # speculative decoding (npuw_kv/generation/speculative.py): only the PagedAttention runner
    # verifies (trees too where its model was built with a tree mask); the static runner also
    # truncates (its beams, generation/beams_alone.py)
    def verify(self, tokens: Sequence[int], parents: Sequence[int] | None = None) -> np.ndarray:
        """Feed ``tokens`` in one call; the logits after each of them, ``[n, vocab]``.
        ``parents``: the tokens are a tree, each after its parent (-1: after the cache)."""
        raise ValueError(SPECULATIVE_PATH)

    def truncate(self, length: int) -> None:
        """Drop the KV of the sequence's tokens from ``length`` on."""
        raise ValueError(SPECULATIVE_PATH)

    def can_truncate(self, length: int) -> bool:
        """Whether :meth:`truncate` to ``length`` would keep the cache right (asked by the
        static path's beams; speculative decoding truncates the paged runner directly)."""
        return False

    def release(self) -> None:  # noqa: B027 (a no-op unless overridden)
        """The lone call's sequence is no longer live (the paged path gives its blocks back,
        cached); the static path keeps its KV in place for the next prompt either way."""

    def hold_prefix(self, tokens: int) -> None:  # noqa: B027 (a no-op unless overridden)
        """Keep the KV of the next prompt's first ``tokens`` tokens (a chat's system prompt)
        cached longest; only the PagedAttention runner has priorities to do it with."""

    @abstractmethod
    def forget_prefixes(self) -> None:
        """Drop every cached prefix and the last sequence's KV: the model computes other KV
        from now on (another LoRA adapter applies)."""

    @property
    @abstractmethod
    def tokens_in_cache(self) -> int:
        """Tokens of the current sequence whose KV the cache holds."""

    @property
    @abstractmethod
    def remaining_capacity(self) -> int:
        """How many more tokens can be generated before the KV cache is full."""

    @property
    @abstractmethod
    def cached_tokens(self) -> int:
        """Tokens whose KV is kept for later prompts to reuse."""

    @property
    @abstractmethod
    def shared_weights(self) -> bool:
        """True when one compiled model (one copy of the weights) serves both phases."""

    @property
    @abstractmethod
    def host_bytes_copied(self) -> int:
        """KV bytes the host copied (staging, prefix store, block moves)."""

    def stats(self) -> dict[str, Any]:
        """KV memory and host-copy accounting of the last request."""
        cache = self.cache
        return {
            "kv_bytes_allocated": cache.bytes_allocated,
            "kv_capacity_tokens": cache.capacity,
            "kv_bytes_per_token": cache.bytes_per_token(),
            "kv_precision": cache.precision,
            "tokens_in_cache": self.tokens_in_cache,
            "reused_tokens": self.reused_tokens,
            "cached_tokens": self.cached_tokens,
            "kv_binding": self.kv_binding,
            "shared_weights": self.shared_weights,
            "host_bytes_copied": self.host_bytes_copied,
            "prefill_host_bytes_copied": self.prefill_copied_bytes,
            "switch_host_bytes_copied": self.switch_copied_bytes,
        }
