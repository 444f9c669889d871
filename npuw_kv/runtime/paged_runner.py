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

A sliding-window model's layers are grouped by window, each group with its own pool, block
table input and cache tensors sized for that pool: a windowed layer holds the blocks its
window reads, and the manager detaches the older ones from it alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import openvino as ov

from ..errors import CapacityError
from ..kv.blocks import BlockManagerConfig, KVBlockManager, PoolKind, uniform_layers
from ..kv.blocks.sequence import blocks_for, min_live_blocks
from ..kv.paged_cache import PagedKVCache, PagedSpec
from ..model.paged_rewrite import CACHE_PREFIXES, LOGITS_ROWS, block_table_input, cache_inputs
from .runner import ChunkHook, Runner


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
    ) -> None:
        """``capacity``: tokens one sequence may hold; ``prefix_cache_tokens``: room beyond it,
        so that earlier prompts' blocks stay cached while a sequence of full length runs.
        ``windows``: the attention window of each layer (None: full; default all full), whose
        block tables the model takes as ``block_table_input(window)``."""
        self.request = request
        self._rows_input = any(
            LOGITS_ROWS in i.get_names() for i in request.get_compiled_model().inputs
        )
        self.kv_binding = "paged"
        # the device writes every token's KV into the cache in place: the host copies none
        # (only a prefix hit on a sliding-window block a live sequence holds moves a block)
        self.prefill_copied_bytes = self.switch_copied_bytes = self._moved_bytes = 0
        self.capacity = capacity
        self.max_prompt_len = max_prompt_len
        self.chunk = chunk
        self.prefix_reuse = prefix_reuse
        ports = cache_inputs(request.get_compiled_model())
        specs = [
            PagedSpec(
                p.get_any_name(),
                p.get_element_type(),
                tuple(d.get_length() for d in list(p.get_partial_shape())[1:]),
            )
            for p in ports
        ]
        # V blocks are [heads, block_size, dims]; u8 K blocks carry extra scale rows
        values = [s for s in specs if s.name.startswith("value_cache.")]
        block_size = values[0].block_shape[1]
        heads, _, dims = values[0].block_shape
        windows = tuple(windows) if windows is not None else (None,) * len(values)
        if len(windows) != len(values):
            raise ValueError(f"{len(windows)} windows for {len(values)} cache layers")
        self._layers = uniform_layers(windows, heads, dims)
        room = capacity + prefix_cache_tokens
        # manager key of each window (full attention: the capacity) -> primary blocks
        self._pool_blocks = _pool_blocks(windows, capacity, room, block_size, chunk)
        keys = [capacity if w is None else w for w in windows]
        # each sliding window's tensors get one block more, kept zero: see _tables
        extra = {key: 0 if key == capacity else 1 for key in self._pool_blocks}
        sizes = {
            f"{prefix}{layer}": self._pool_blocks[key] + extra[key]
            for layer, key in enumerate(keys)
            for prefix in CACHE_PREFIXES
        }
        self.cache = PagedKVCache(specs, room, block_size, sizes)
        self._names = {  # manager key -> the cache tensors of its layers
            key: [f"{p}{layer}" for layer, k in enumerate(keys) if k == key for p in CACHE_PREFIXES]
            for key in self._pool_blocks
        }
        for key, names in self._names.items():
            if extra[key]:
                for name in names:
                    self.cache.tensors[name].data[self._pool_blocks[key]] = 0
        for name, tensor in self.cache.tensors.items():
            request.set_tensor(name, tensor)
        self._inputs = {key: block_table_input(None if key == capacity else key) for key in keys}
        self.blocks = self._new_manager()
        self._seq = 0  # id of the live sequence; 0: none yet
        self.reused_tokens = 0
        self._dirty = False  # a call failed part-way and the manager was not rebuilt yet
        # u8 blocks written one token at a time get other scales than a fresh prefill writes:
        # generated tokens' blocks are cached only for float KV, where they are the same
        self._store_steps = self.cache.precision in ("f32", "f16", "bf16")
        # beam search (runtime/beam_tables.py): the most distinct KV blocks the beams of the
        # last search held at once, and the bytes its copy-on-write block copies moved
        self.beam_peak_blocks = self.beam_copied_bytes = 0

    def _new_manager(self) -> KVBlockManager:
        """Slots for exactly the cache's blocks; the bytes stay in the cache tensors."""
        config = BlockManagerConfig(
            layers=self._layers,
            max_seq_len=self.capacity,
            primary_blocks=self._pool_blocks,
            tokens_per_block=self.cache.block_size,
            # blocks are stored even while ``prefix_reuse`` is off, so turning it on finds them
            enable_reuse=True,
            max_tokens_per_call=self.chunk,
        )
        return KVBlockManager(config, copy_slots=self._copy_block)

    def _copy_block(
        self, window: int, src_pool: PoolKind, src: int, dst_pool: PoolKind, dst: int
    ) -> None:
        """The manager moves a block's bytes: for a prefix hit on a sliding-window layer's
        block that a live sequence holds (there is no host pool: both slots are the
        device's).  Counted."""
        if PoolKind.HOST in (src_pool, dst_pool):
            raise RuntimeError("the paged KV cache has no host pool")
        for name in self._names[window]:
            tensor = self.cache.tensors[name]
            tensor.data[dst] = tensor.data[src]
            self._moved_bytes += tensor.data[dst].nbytes

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
        return min(windows[w].cached_blocks for w in self._pool_blocks) * self.cache.block_size

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
            table[table < 0] = self._pool_blocks[key]
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
            size = self.chunk
            edges = [start, *range((start // size + 1) * size, ids.size, size), ids.size]
            logits = np.empty((1, 0), np.float32)
            for begin, end in zip(edges, edges[1:], strict=False):
                if begin == start:
                    reused = self.blocks.add_sequence(
                        self._seq, prompt[:end], reuse=self.prefix_reuse
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


def _pool_blocks(
    windows: Sequence[int | None], capacity: int, room: int, block_size: int, chunk: int
) -> dict[int, int]:
    """Blocks of each window's pool, keyed as the manager keys windows (full: ``capacity``).

    Full attention: ``room`` tokens.  A sliding window: what one sequence needs at most (its
    window plus a chunk, ``min_live_blocks``) plus the prefix-cache room, never more than full.
    """
    full = blocks_for(room, block_size)
    pools = {}
    for window in windows:
        if window is None:
            pools[capacity] = full
        else:
            need = min_live_blocks(capacity, window, block_size, chunk)
            pools[window] = min(full, need + blocks_for(room - capacity, block_size))
    return pools
