"""Prefill chunks and generate steps of a PagedAttention model over one paged KV cache.

The same infer request runs both phases: a chunk of the prompt or one generated token, the
number of tokens already cached (``past_lens``) and the sequence's block table.  The device
writes each token's KV into its block of the cache tensors bound once at start, so nothing is
copied, ever: not per chunk, not at the prefill -> generate switch.

Which block holds what is the block manager's (``kv/blocks``): every prompt is a sequence, and
its full blocks stay cached in the manager's reuse tree after it ends, until the space is
needed (priority, then least recently used).  So a prompt reuses the longest cached prefix of
*any* earlier prompt or answer, not only the last one: a system prompt shared by many chats,
or two documents asked about in turn.  A u8 block's scales depend on which of its tokens were
written together, so everything reused is written as a fresh run writes it: whole blocks only
(the partial one is rerun from its start), chunks that end where a fresh run's do, and on u8
no block that generated tokens completed (written one token at a time).  A continuation then
gives a fresh run's logits bit for bit.

A sliding-window model's layers are grouped by window, each with its own pool, block table
input and cache tensors: a windowed layer holds the blocks its window reads.  Beyond what one
sequence needs, ``prefix_cache_tokens`` of room (device pools) and ``prefix_cache_host_tokens``
(a host tier the evicted blocks move to, and come back from on a hit) are split between the
windows by ``kv_window_shares``.  A chat's system prompt is held at SYSTEM_PRIORITY.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import openvino as ov

from ..errors import CapacityError
from ..kv.blocks import (
    BlockManagerConfig,
    KVBlockManager,
    PoolKind,
    PriorityRange,
    Shares,
    assign_shares,
    format_shares,
    parse_window_shares,
    uniform_layers,
    window_label,
)
from ..kv.paged_cache import (
    HostTier,
    PagedKVCache,
    PagedSpec,
    PoolPlan,
    block_bytes,
    plan_pools,
)
from ..model.paged_rewrite import CACHE_PREFIXES, LOGITS_ROWS, block_table_input, cache_inputs
from .runner import ChunkHook, Runner

#: retention priority of a chat's system prompt blocks (the manager's default is 35, max 100)
SYSTEM_PRIORITY = 90


class PagedRunner(Runner):
    cache: PagedKVCache

    def __init__(
        self,
        request: ov.InferRequest,
        capacity: int,
        max_prompt_len: int,
        chunk: int,
        prefix_reuse: bool = False,
        prefix_cache_tokens: int = 0,
        windows: Sequence[int | None] | None = None,
        host_tokens: int = 0,
        shares: Shares | None = None,
        shares_source: str = "kv_window_shares",
    ) -> None:
        """``capacity``: tokens one sequence may hold; ``prefix_cache_tokens``: room beyond it,
        so that earlier prompts' blocks stay cached while a sequence of full length runs.
        ``windows``: the attention window of each layer (None: full; default all full), whose
        block tables the model takes as ``block_table_input(window)``.  ``host_tokens``: the
        host tier, where blocks evicted from the pools go; ``shares`` (parsed, from the
        setting ``shares_source``): how the room and the host tier split between windows."""
        self.request = request
        self._rows_input = any(
            LOGITS_ROWS in i.get_names() for i in request.get_compiled_model().inputs
        )
        self.kv_binding = "paged"
        # the device writes every token's KV into the cache in place: the host copies none
        # (only a prefix hit on a sliding-window block a live sequence holds moves a block,
        # and the host tier's offloads and restores)
        self.prefill_copied_bytes = self.switch_copied_bytes = self._moved_bytes = 0
        self.capacity = capacity
        self.max_prompt_len = max_prompt_len
        self.chunk = chunk
        self.prefix_reuse = prefix_reuse
        ports = cache_inputs(request.get_compiled_model())
        self._specs = [
            PagedSpec(
                p.get_any_name(),
                p.get_element_type(),
                tuple(d.get_length() for d in list(p.get_partial_shape())[1:]),
            )
            for p in ports
        ]
        # V blocks are [heads, block_size, dims]; u8 K blocks carry extra scale rows
        values = [s for s in self._specs if s.name.startswith("value_cache.")]
        self._block_size = values[0].block_shape[1]
        heads, _, dims = values[0].block_shape
        self._windows = tuple(windows) if windows is not None else (None,) * len(values)
        if len(self._windows) != len(values):
            raise ValueError(f"{len(self._windows)} windows for {len(values)} cache layers")
        self._layers = uniform_layers(self._windows, heads, dims)
        self._room, self._host_tokens = prefix_cache_tokens, host_tokens
        self._keys = [capacity if w is None else w for w in self._windows]
        self._names = {  # manager key -> the cache tensors of its layers
            key: [
                f"{p}{layer}"
                for layer, k in enumerate(self._keys)
                if k == key
                for p in CACHE_PREFIXES
            ]
            for key in sorted(set(self._keys))
        }
        self._inputs = {
            key: block_table_input(None if key == capacity else key) for key in self._keys
        }
        self._allocate(self._plan(shares, shares_source))
        self._seq = 0  # id of the live sequence; 0: none yet
        self.reused_tokens = 0
        self._dirty = False  # a call failed part-way and the manager was not rebuilt yet
        # tokens at the start of the next prompt kept at SYSTEM_PRIORITY (hold_prefix)
        self._held = self.held_tokens = 0
        # u8 blocks written one token at a time get other scales than a fresh prefill writes:
        # generated tokens' blocks are cached only for float KV, where they are the same
        self._store_steps = self.cache.precision in ("f32", "f16", "bf16")
        # beam search (runtime/beam_tables.py): the most distinct KV blocks the beams of the
        # last search held at once, and the bytes its copy-on-write block copies moved
        self.beam_peak_blocks = self.beam_copied_bytes = 0

    def _plan(self, shares: Shares | None, source: str) -> PoolPlan:
        """Pool sizes for ``shares`` (checked against the model's windows, errors naming
        ``source``), before anything is allocated."""
        split = None
        if shares is not None:
            split = assign_shares(shares, sorted(self._names), self.capacity, source)
            if not self._room and not self._host_tokens:
                warnings.warn(
                    f"{source} has nothing to split: it shares out prefix_cache_tokens and "
                    "prefix_cache_host_tokens, both 0 (each pool holds what one sequence needs)",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return plan_pools(
            self._windows,
            self.capacity,
            self._room,
            self._host_tokens,
            self._block_size,
            self.chunk,
            block_bytes(self._specs, self._names),
            split,
        )

    def _allocate(self, plan: PoolPlan) -> None:
        """Cache tensors and host tier sized by ``plan``, bound to the request; an empty
        manager over them.  Nothing changes if an allocation fails."""
        # each sliding window's tensors get one block more, kept zero: see _tables
        extra = {key: 0 if key == self.capacity else 1 for key in plan.primary}
        sizes = {
            f"{prefix}{layer}": plan.primary[key] + extra[key]
            for layer, key in enumerate(self._keys)
            for prefix in CACHE_PREFIXES
        }
        cache = PagedKVCache(self._specs, self.capacity + self._room, self._block_size, sizes)
        host = HostTier(cache, self._names, plan.host, self._host_tokens)
        for key, names in self._names.items():
            if extra[key]:
                for name in names:
                    cache.tensors[name].data[plan.primary[key]] = 0
        for name, tensor in cache.tensors.items():
            self.request.set_tensor(name, tensor)
        self.cache, self.host, self.pools = cache, host, plan
        self.blocks = self._new_manager()

    def set_window_shares(self, value: object, source: str = "kv_window_shares") -> str | None:
        """Split the prefix-cache room and the host tier between the window pools anew (None:
        the default split); the cached prefixes are dropped.  Bad shares raise a ValueError
        naming ``source`` with nothing changed.  Returns the shares' canonical text."""
        shares = None if value is None else parse_window_shares(value, source)
        self._allocate(self._plan(shares, source))  # a new, empty manager
        self.reused_tokens = 0
        return None if shares is None else format_shares(shares)

    def hold_prefix(self, tokens: int) -> None:
        """Keep the next prompt's first ``tokens`` tokens (a chat's system prompt), in whole
        blocks, at SYSTEM_PRIORITY: evicted after every other cached block."""
        self._held = max(0, int(tokens))

    def _new_manager(self) -> KVBlockManager:
        """Slots for exactly the cache's blocks; the bytes stay in the cache tensors."""
        config = BlockManagerConfig(
            layers=self._layers,
            max_seq_len=self.capacity,
            primary_blocks=self.pools.primary,
            host_blocks=self.pools.host,
            tokens_per_block=self.cache.block_size,
            # blocks are stored even while ``prefix_reuse`` is off, so turning it on finds them
            enable_reuse=True,
            max_tokens_per_call=self.chunk,
        )
        return KVBlockManager(config, copy_slots=self._copy_block)

    def _copy_block(
        self, window: int, src_pool: PoolKind, src: int, dst_pool: PoolKind, dst: int
    ) -> None:
        """The manager moves a block's bytes: a prefix hit on a sliding-window layer's block
        that a live sequence holds (device slot to device slot), a block evicted to the host
        tier or restored from it on a hit.  Counted."""
        hosted = (src_pool is PoolKind.HOST, dst_pool is PoolKind.HOST)
        self._moved_bytes += self.host.copy(self.cache, self._names[window], src, dst, hosted)

    # -- state -------------------------------------------------------------------------------
    @property
    def shared_weights(self) -> bool:
        return True  # one compiled model runs both phases

    @property
    def host_bytes_copied(self) -> int:
        return self._moved_bytes

    @property
    def tokens_in_cache(self) -> int:
        """Tokens of the current sequence (prompt and fed answer) whose KV the cache holds."""
        return self.blocks.num_tokens(self._seq) if self._seq in self.blocks.sequence_ids else 0

    @property
    def remaining_capacity(self) -> int:
        """How many more tokens can be generated before the KV cache is full."""
        return self.capacity - self.tokens_in_cache

    @property
    def cached_tokens(self) -> int:
        """Tokens in the reuse tree's blocks, over every cached prefix (the live sequence's
        included); a later prompt can start from at most the longest of those prefixes.  With
        sliding windows, the fewest over the windows (a hit needs every window)."""
        windows = self.blocks.stats().windows
        return min(windows[w].cached_blocks for w in self.pools.primary) * self.cache.block_size

    def stats(self) -> dict[str, Any]:
        """The common accounting, and the pools and tiers of the block manager: blocks per
        window pool (with the shares applied), the host tier's bytes (held now; offloaded and
        restored so far), and the blocks held at a chat system prompt's priority."""
        manager = self.blocks.stats().windows
        label = {key: window_label(key, self.capacity) for key in self.pools.primary}
        return {
            **super().stats(),
            "kv_pool_blocks": {label[k]: n for k, n in self.pools.primary.items()},
            "kv_window_shares": {label[k]: round(s, 6) for k, s in self.pools.shares.items()},
            "kv_window_shares_given": self.pools.given,
            "host_tier_blocks": {label[k]: n for k, n in self.pools.host.items()},
            "host_tier_bytes_allocated": self.host.bytes_allocated,
            "host_tier_bytes_held": sum(
                manager[k].host_held * self.host.block_bytes[k] for k in self.pools.host
            ),
            "host_tier_bytes_offloaded": self.host.offloaded_bytes,
            "host_tier_bytes_restored": self.host.restored_bytes,
            "host_tier_offloads": sum(w.counters.offloads for w in manager.values()),
            "host_tier_restores": sum(w.counters.onboards for w in manager.values()),
            "priority_held_tokens": self.held_tokens,
            "priority_held_blocks": sum(w.priority_blocks for w in manager.values()),
        }

    # -- phases ------------------------------------------------------------------------------
    def _tables(self, blocks: int) -> dict[str, np.ndarray]:
        """Each window's block table for the first ``blocks`` blocks of the sequence.

        A sliding-window layer's blocks before its window are detached (the manager gives
        -1).  The kernel still reads a block for each table entry, and masks those outside
        the window; so they point at the zero block after its pool (finite: weight 0).
        """
        tables = {}
        for key, name in self._inputs.items():
            table = np.array(self.blocks.block_table(self._seq, key)[:blocks], np.int32)
            table[table < 0] = self.pools.primary[key]
            tables[name] = table
        return tables

    def _infer(self, ids: np.ndarray, past: int, rows: int = 1) -> np.ndarray:
        n, total = int(ids.size), past + int(ids.size)
        blocks = self.cache.blocks_for(total)
        # the model's LM head runs on the last ``rows`` tokens (none: every token)
        extra = {LOGITS_ROWS: np.array([rows], np.int64)} if self._rows_input else {}
        self.request.infer(
            {
                "input_ids": ids,
                "position_ids": np.arange(past, total, dtype=np.int64),
                "past_lens": np.array([past], np.int32),
                "subsequence_begins": np.array([0, n], np.int32),
                "block_indices_begins": np.array([0, blocks], np.int32),
                "max_context_len": np.array(total, np.int32),
                **self._tables(blocks),
                **extra,
            }
        )
        logits = self.request.get_tensor("logits").data
        return logits.reshape(-1, logits.shape[-1])  # [1, vocab], or [n, vocab] (full logits)

    def prefill(self, ids: np.ndarray, on_chunk: ChunkHook | None = None) -> np.ndarray:
        """Run ``ids`` in chunks after the longest cached prefix; return the last logits.

        Chunks end where a fresh run's do (multiples of C), so every block is written in the
        same calls as in a fresh run: a u8 block's scales depend on that.
        ``on_chunk(positions, logits)`` as in :meth:`StaticRunner.prefill`.
        """
        ids = np.asarray(ids, np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("prompt is empty: at least one token is needed")
        if ids.size > self.max_prompt_len:
            raise CapacityError.prompt(ids.size, self.max_prompt_len)
        with self._writing():
            if self._seq in self.blocks.sequence_ids:
                self.blocks.remove_sequence(self._seq)  # its full blocks stay cached for reuse
            self._seq += 1
            prompt = ids.tolist()
            # whole blocks, >= 1 token left to run
            start = self.blocks.lookup(prompt).hit_tokens if self.prefix_reuse else 0
            self.reused_tokens = start
            held, self._held = self._held // self.cache.block_size * self.cache.block_size, 0
            self.held_tokens = held
            priority = [PriorityRange(0, held, SYSTEM_PRIORITY)] if held else None
            size = self.chunk
            edges = [start, *range((start // size + 1) * size, ids.size, size), ids.size]
            logits = np.empty((1, 0), np.float32)
            for begin, end in zip(edges, edges[1:], strict=False):
                if begin == start:
                    reused = self.blocks.add_sequence(
                        self._seq, prompt[:end], priority, reuse=self.prefix_reuse
                    )
                    if reused != start:  # the device is told `start` tokens are cached
                        raise RuntimeError(f"block manager reused {reused} tokens, not {start}")
                else:
                    self.blocks.add_tokens(self._seq, prompt[begin:end])
                logits = self._infer(ids[begin:end], begin)
                if on_chunk is not None:
                    positions = np.arange(begin, end)[-logits.shape[0] :]
                    on_chunk(positions, logits)
        return logits[-1].copy()

    def step(self, token: int) -> np.ndarray:
        """Feed one token, write its KV into the next slot, return the next logits."""
        if self.remaining_capacity <= 0:
            raise CapacityError.cache_full(self.capacity)
        past = self.tokens_in_cache
        with self._writing():
            self.blocks.add_token(self._seq, int(token), store=self._store_steps)
            logits = self._infer(np.array([token], np.int64), past)
        return logits[-1].copy()

    # -- speculative decoding: several tokens checked in one call, the rejected ones dropped --
    def verify(self, tokens: Sequence[int]) -> np.ndarray:
        """Feed ``tokens`` as one chunk; the logits after each of them, ``[n, vocab]``.

        Row i predicts the token after ``tokens[i]``: a speculative decoder compares it with
        candidate i + 1.  The KV of every token is written; :meth:`truncate` drops what the
        decoder rejects.
        """
        ids = np.asarray(tokens, np.int64).reshape(-1)
        if not 0 < ids.size <= self.chunk:
            raise ValueError(f"verify takes 1 to {self.chunk} tokens, got {ids.size}")
        if self.remaining_capacity < ids.size:
            raise CapacityError.cache_full(self.capacity)
        past = self.tokens_in_cache
        with self._writing():
            self.blocks.add_tokens(self._seq, ids.tolist(), store=self._store_steps)
            logits = self._infer(ids, past, rows=int(ids.size))
        return logits[-ids.size :].copy()

    def truncate(self, length: int) -> None:
        """Keep the KV of the sequence's first ``length`` tokens (at least the prompt's).  The
        manager releases the blocks past it and takes every block no longer full out of the
        reuse tree, so no rejected token's row is ever reused; the slots are overwritten by
        the next call."""
        if length < self.tokens_in_cache:  # the manager checks all before changing anything
            self.blocks.truncate(self._seq, length)

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """Blocks are registered (and cached) before the device writes them.  If a call fails
        part-way, forget every cached block, so none the device never wrote is reused; should
        that itself be interrupted, the next call does it first."""
        if self._dirty:
            self._forget()
        self._dirty = True
        try:
            yield
        except BaseException:
            self._forget()
            raise
        self._dirty = False

    def _forget(self) -> None:
        self.blocks = self._new_manager()
        self.reused_tokens = 0
        self._dirty = False
