"""Counters and events the manager reports.

Hit/miss figures are in prompt tokens: ``hit_tokens`` were taken from the cache by
``add_sequence``, ``miss_tokens`` must be computed, so ``hit_tokens + miss_tokens`` equals every
prompt token ever added. Block counters are per window. Events are kept in a bounded buffer
(oldest dropped) and handed out by ``drain_events``; counters are never dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class KVCacheEvent:
    """A block changed place in one window's cache.

    ``kind`` is ``"stored"`` / ``"removed"`` (the block entered / left the reuse tree) or
    ``"offloaded"`` / ``"onboarded"`` (its bytes moved primary -> host / host -> primary; it
    keeps its place in the tree). A moved block that is not cached yet (a detached SWA block
    its live sequence may still store) has ``block_hash == parent_hash == 0``.
    """

    kind: str
    window_size: int
    block_hash: int
    parent_hash: int
    num_tokens: int


@dataclass
class WindowCounters:
    """Running totals of one window group."""

    allocated_blocks: int = 0  # handed out fresh by the free-block path
    reused_blocks: int = 0  # claimed from the reuse tree on a hit
    copied_blocks: int = 0  # SWA hit on a block another live sequence holds: copied
    detached_blocks: int = 0
    offloads: int = 0
    onboards: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    invalidated_sequences: int = 0  # SWA sequences not stored because a block was reclaimed


@dataclass(frozen=True)
class WindowStats:
    """Snapshot of one window group."""

    window_size: int
    is_swa: bool
    num_layers: int
    bytes_per_token: int
    tokens_per_block: int
    primary_total: int
    primary_free: int
    host_total: int
    host_free: int
    cached_blocks: int
    #: bytes the manager's own stores hold (0 where a runtime keeps the bytes: ``copy_slots``)
    primary_bytes: int
    host_bytes: int
    counters: WindowCounters
    #: host blocks holding bytes worth keeping (cached, or kept for storing): the host tier's load
    host_held: int = 0
    #: blocks cached or in use at a priority above the default (e.g. a chat's system prompt)
    priority_blocks: int = 0

    @property
    def primary_used(self) -> int:
        return self.primary_total - self.primary_free

    @property
    def host_used(self) -> int:
        return self.host_total - self.host_free

    @property
    def bytes_in_use(self) -> int:
        return self.primary_used * self.bytes_per_token * self.tokens_per_block


@dataclass(frozen=True)
class ManagerStats:
    """Snapshot across windows."""

    windows: dict[int, WindowStats]
    live_sequences: int
    sequences_added: int
    sequences_removed: int
    prompt_tokens: int
    hit_tokens: int
    miss_tokens: int
    lookups: int
    events_dropped: int
    extra: dict[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        total = self.hit_tokens + self.miss_tokens
        return self.hit_tokens / total if total else 0.0

    @property
    def bytes_allocated(self) -> int:
        """Bytes of block storage (primary + host) the pools hold."""
        return sum(w.primary_bytes + w.host_bytes for w in self.windows.values())

    @property
    def offloads(self) -> int:
        return sum(w.counters.offloads for w in self.windows.values())

    @property
    def onboards(self) -> int:
        return sum(w.counters.onboards for w in self.windows.values())
