"""The memory behind the PagedAttention runner: one block pool per attention window.

A sliding-window model's layers are grouped by window, each group with its own pool, block
table input and cache tensors: a windowed layer holds the blocks its window reads.  Beyond
what one sequence needs, ``prefix_cache_tokens`` of room (device pools) and
``prefix_cache_host_tokens`` (a host tier the evicted blocks move to, and come back from on a
hit) are split between the windows by ``kv_window_shares``.  :class:`PagedPools` sizes the
pools, allocates the cache tensors and the host tier, binds them to the request once, and
makes the block manager that places blocks in them; the runner only runs tokens.
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import openvino as ov

from ...config.settings import label
from ...errors import UsageError
from ...kv.blocks import (
    BlockManagerConfig,
    HybridBlockManager,
    KVBlockManager,
    PoolKind,
    Shares,
    assign_shares,
    format_shares,
    parse_window_shares,
    uniform_layers,
    window_label,
)
from ...kv.paged_cache import (
    HostTier,
    PagedKVCache,
    PagedSpec,
    PoolPlan,
    block_bytes,
    blocks_for,
    plan_pools,
    sequence_blocks,
)
from ...model.paged_rewrite import CACHE_PREFIXES, block_table_input, cache_inputs
from .states import PagedStates


class PagedPools:
    """Cache tensors, host tier and block manager of one PagedAttention request."""

    cache: PagedKVCache
    host: HostTier
    plan: PoolPlan
    blocks: KVBlockManager

    def __init__(
        self,
        request: ov.InferRequest,
        *,
        capacity: int,
        chunk: int,
        windows: Sequence[int | None] | None,
        room: int,
        host_tokens: int,
        shares: Shares | None,
        shares_source: str,
        state_interval: int = 0,
    ) -> None:
        """``capacity``: tokens one sequence may hold; ``room``: prefix-cache tokens beyond
        it; ``windows``: each layer's attention window (None: full; default all full);
        ``state_interval``: tokens between a hybrid model's state checkpoints (whole blocks;
        0: the chunk rounded up to blocks)."""
        self.request = request
        self.capacity, self.chunk = capacity, chunk
        self.room, self.host_tokens = room, host_tokens
        self.specs = [
            PagedSpec(
                p.get_any_name(),
                p.get_element_type(),
                tuple(d.get_length() for d in list(p.get_partial_shape())[1:]),
            )
            for p in cache_inputs(request.get_compiled_model())
        ]
        # V blocks are [heads, block_size, dims]; u8 K blocks carry extra scale rows
        values = [s for s in self.specs if s.name.startswith("value_cache.")]
        self.block_size = values[0].block_shape[1]
        heads, _, dims = values[0].block_shape
        self.windows = tuple(windows) if windows is not None else (None,) * len(values)
        if len(self.windows) != len(values):
            raise ValueError(f"{len(self.windows)} windows for {len(values)} cache layers")
        self.layers = uniform_layers(self.windows, heads, dims)
        self.keys = [capacity if w is None else w for w in self.windows]  # manager key per layer
        self.names = {  # manager key -> the cache tensors of its layers
            key: [
                f"{p}{layer}"
                for layer, k in enumerate(self.keys)
                if k == key
                for p in CACHE_PREFIXES
            ]
            for key in sorted(set(self.keys))
        }
        self.table_inputs = {
            key: block_table_input(None if key == capacity else key) for key in self.keys
        }
        self.moved_bytes = 0  # block moves: SWA prefix hits, host-tier offloads and restores
        self._shares, self._source = shares, shares_source
        self.states = PagedStates.of(request, self._interval(state_interval))  # a hybrid's
        if self.states is None and state_interval:
            warnings.warn(
                f"{label('state_checkpoint_interval')} has no effect: the model has no "
                "linear-attention layers (as genai ignores cache_interval_multiplier there)",
                RuntimeWarning,
                stacklevel=2,
            )
        self.allocate(self.plan_for(shares, shares_source))

    # -- a hybrid model's linear-attention states ----------------------------------------------
    def _interval(self, given: int) -> int:
        """Tokens between state checkpoints: ``given`` (whole blocks), or the chunk rounded up
        to blocks, so that a prompt's chunks end where checkpoints are."""
        if given % self.block_size:
            raise UsageError(
                f"{label('state_checkpoint_interval')} must be whole KV blocks of "
                f"{self.block_size} tokens, got {given}"
            )
        return given or blocks_for(self.chunk, self.block_size) * self.block_size

    def _max_checkpoints(self) -> int:
        """One state checkpoint per interval of the tokens the KV pools hold."""
        assert self.states is not None
        return -(-(self.capacity + self.room) // self.states.interval)

    def state_paging(
        self, parts: Sequence[tuple[Hashable, int, int]], per_token: bool = False
    ) -> dict[str, np.ndarray]:
        """The inputs addressing the state tables in one call over ``parts`` (``(sequence,
        past, new tokens)``); none for a model without linear-attention layers."""
        if self.states is None:
            return {}
        assert isinstance(self.blocks, HybridBlockManager)
        return self.states.inputs(self.blocks.state_paging(parts, per_token))

    def unwritten_states(self) -> list[str]:
        """The state tables the device does not write (:meth:`PagedStates.unwritten`)."""
        if self.states is None:
            return []
        tables = {name: np.zeros(1, np.int32) for name in self.table_inputs.values()}
        return self.states.unwritten(tables, list(self.cache.tensors.values()))

    @property
    def windowed(self) -> bool:
        """True when some layer has a sliding window (more than one block table)."""
        return list(self.table_inputs) != [self.capacity]

    def plan_for(self, shares: Shares | None, source: str) -> PoolPlan:
        """Pool sizes for ``shares`` (checked against the model's windows, errors naming
        ``source``), before anything is allocated."""
        split = None
        if shares is not None:
            split = assign_shares(shares, sorted(self.names), self.capacity, source)
            if not self.room and not self.host_tokens:
                warnings.warn(
                    f"{source} has nothing to split: it shares out prefix_cache_tokens and "
                    "prefix_cache_host_tokens, both 0 (each pool holds what one sequence needs)",
                    RuntimeWarning,
                    stacklevel=4,
                )
        return plan_pools(
            self.windows,
            self.capacity,
            self.room,
            self.host_tokens,
            self.block_size,
            self.chunk,
            block_bytes(self.specs, self.names),
            split,
        )

    def allocate(self, plan: PoolPlan) -> None:
        """Cache tensors and host tier sized by ``plan``, bound to the request; an empty
        manager over them.  Nothing changes if an allocation fails."""
        cache = self._new_cache(plan.primary)
        host = HostTier(cache, self.names, plan.host, self.host_tokens)
        for name, tensor in cache.tensors.items():
            self.request.set_tensor(name, tensor)
        self.cache, self.host, self.plan = cache, host, plan
        self.blocks = self.new_manager()

    def _new_cache(self, primary: dict[int, int]) -> PagedKVCache:
        """Cache tensors of ``primary``'s blocks per window key, for the capacity and room."""
        sizes = {
            f"{prefix}{layer}": primary[key]
            for layer, key in enumerate(self.keys)
            for prefix in CACHE_PREFIXES
        }
        return PagedKVCache(self.specs, self.capacity + self.room, self.block_size, sizes)

    def set_window_shares(self, value: object, source: str) -> str | None:
        """Split the room and the host tier between the window pools anew (None: the default
        split); the cached prefixes are dropped.  Bad shares raise a ValueError naming
        ``source`` with nothing changed.  Returns the shares' canonical text."""
        shares = None if value is None else parse_window_shares(value, source)
        self.allocate(self.plan_for(shares, source))
        self._shares, self._source = shares, source
        return None if shares is None else format_shares(shares)

    def set_room(self, room: int) -> None:
        """``room`` prefix-cache tokens beyond one sequence's, split as the shares say; the
        pools are allocated anew (the cached prefixes dropped)."""
        before = self.room
        self.room = room
        try:
            self.allocate(self.plan_for(self._shares, self._source))
        except BaseException:
            self.room = before
            raise

    def fit_batch(self, sequences: int, tokens: int, step_tokens: int | None = None) -> bool:
        """Pools that hold ``sequences`` sequences of ``tokens`` tokens at once, grown where
        smaller: a full-attention pool by their tokens, a sliding-window pool by what each
        sequence keeps live: its window and a block while it decodes or waits (the scheduler
        detaches what a waiting sequence's next token cannot see), and more in a step that
        reads its prompt.  A step reads at most ``step_tokens`` prompt tokens (the scheduler's
        budget, by default a chunk); beyond what it holds decoding, a reader of ``a`` tokens
        holds the blocks its read adds: ``ceil(a / block) - 1`` when the read starts at a block
        boundary (a chunk boundary or a prefix hit), one more for the one read a step may
        continue where the budget cut it.  So a step's readers hold at most
        ``ceil(step_tokens / block) + 1`` blocks more, however many they are (and no more than
        each holds reading a whole chunk).  More sequences fit than with every layer whole.
        With no sequence live the pools are allocated anew (the cached prefixes dropped); with
        some live they grow keeping every block.  Nothing changes if allocating fails.  True if
        they grew."""
        keys, length = list(self.plan.primary), min(tokens, self.capacity)
        decoding = sequence_blocks(keys, self.capacity, length, self.block_size, 1)
        reading = sequence_blocks(keys, self.capacity, length, self.block_size, self.chunk)
        step = self.chunk if step_tokens is None else step_tokens
        read = blocks_for(step, self.block_size) + 1
        need = {
            k: sequences * decoding[k] + min(sequences * (reading[k] - decoding[k]), read)
            for k in keys
        }
        if all(self.plan.primary[k] >= n for k, n in need.items()):
            return False
        live = bool(self.blocks.sequence_ids)
        # with sequences live more are joining one by one (threads): grow by a quarter at
        # least, so that N joiners cost a few reallocations, not N (a larger step leaves
        # blocks that later batches touch, which costs peak RSS)
        primary = dict(self.plan.primary)
        for key, blocks in need.items():
            if blocks > primary[key]:
                primary[key] = max(blocks, (primary[key] + primary[key] // 4) if live else 0)
        before = self.room
        self.room = max(self.room, primary[self.capacity] * self.block_size - self.capacity)
        try:
            if live:
                self._grow(primary)  # sequences are live: their blocks must stay where they are
            else:
                self.allocate(replace(self.plan, primary=primary))
        except BaseException:
            self.room = before
            raise
        return True

    def _grow(self, primary: dict[int, int]) -> None:
        """Larger cache tensors with every block's bytes where it was, bound in place of the
        old ones; the manager's pools get the new blocks, empty.  One tensor at a time: each
        old one is let go once its bytes moved, so the copy holds one layer's tensor twice at
        most (the new tensors' other pages are the OS's lazy zeros until written)."""
        cache = self._new_cache(primary)
        old = self.cache
        self.cache = cache
        for name, tensor in cache.tensors.items():
            before = old.tensors.pop(name)
            tensor.data[: before.get_shape()[0]] = before.data
            self.request.set_tensor(name, tensor)
            del before
        for key, blocks in primary.items():
            if blocks > self.plan.primary[key]:
                self.blocks.grow_primary(key, blocks)
        self.plan = replace(self.plan, primary=primary)

    def table(self, seq: Hashable, window: int, blocks: int) -> np.ndarray:
        """Window ``window``'s block table of sequence ``seq``, its first ``blocks`` blocks.

        A sliding-window layer's blocks before its window are detached (the manager gives
        -1).  The kernel still reads a block for each table entry and masks those outside the
        window, so any block whose bytes are finite will do: they point at the first block
        the sequence still holds, and the pool needs no spare block for them.
        """
        table = np.array(self.blocks.block_table(seq, window)[:blocks], np.int32)
        detached = table < 0
        if detached.any():
            held = table[~detached]
            if held.size == 0:
                raise AssertionError(f"window {window}: every block of the sequence detached")
            table[detached] = held[0]
        return table

    def new_manager(self) -> KVBlockManager:
        """Slots for exactly the cache's blocks; the bytes stay in the cache tensors."""
        config = BlockManagerConfig(
            layers=self.layers,
            max_seq_len=self.capacity,
            primary_blocks=self.plan.primary,
            host_blocks=self.plan.host,
            tokens_per_block=self.block_size,
            # blocks are stored even while prefix reuse is off, so turning it on finds them
            enable_reuse=True,
            max_tokens_per_call=self.chunk,
        )
        if self.states is None:
            return KVBlockManager(config, copy_slots=self._copy_block)
        slots = self.states.slots(self._max_checkpoints())
        return HybridBlockManager(config, copy_slots=self._copy_block, states=slots)

    def _copy_block(
        self, window: int, src_pool: PoolKind, src: int, dst_pool: PoolKind, dst: int
    ) -> None:
        """The manager moves a block's bytes: a prefix hit on a sliding-window layer's block
        that a live sequence holds (device slot to device slot), a block evicted to the host
        tier or restored from it on a hit.  Counted."""
        hosted = (src_pool is PoolKind.HOST, dst_pool is PoolKind.HOST)
        self.moved_bytes += self.host.copy(self.cache, self.names[window], src, dst, hosted)

    def stats(self) -> dict[str, Any]:
        """Blocks per window pool (with the shares applied), the host tier's bytes (held now;
        offloaded and restored so far), and the blocks held at a raised priority."""
        manager = self.blocks.stats().windows
        label = {key: window_label(key, self.capacity) for key in self.plan.primary}
        return {
            "kv_pool_blocks": {label[k]: n for k, n in self.plan.primary.items()},
            "kv_window_shares": {label[k]: round(s, 6) for k, s in self.plan.shares.items()},
            "kv_window_shares_given": self.plan.given,
            "host_tier_blocks": {label[k]: n for k, n in self.plan.host.items()},
            "host_tier_bytes_allocated": self.host.bytes_allocated,
            "host_tier_bytes_held": sum(
                manager[k].host_held * self.host.block_bytes[k] for k in self.plan.host
            ),
            "host_tier_bytes_offloaded": self.host.offloaded_bytes,
            "host_tier_bytes_restored": self.host.restored_bytes,
            "host_tier_offloads": sum(w.counters.offloads for w in manager.values()),
            "host_tier_restores": sum(w.counters.onboards for w in manager.values()),
            "priority_held_blocks": sum(w.priority_blocks for w in manager.values()),
            **self._state_stats(),
        }

    def _state_stats(self) -> dict[str, Any]:
        """The state tables' slots, bytes and checkpoints (a hybrid model's only)."""
        if self.states is None:
            return {}
        assert isinstance(self.blocks, HybridBlockManager)
        return self.states.stats(self.blocks.states)
