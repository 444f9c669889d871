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
reads exactly the KV a fresh run writes; its logits are a fresh run's bit for bit, except
where the CPU's kernels round a shorter rerun chunk differently (SmolLM2 on an AVX2-only
CPU: 3.5e-5).

The cache's memory, one block pool per attention window with its host tier, is
:class:`~.paged_pools.PagedPools`.  A chat's system prompt is held at SYSTEM_PRIORITY.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import openvino as ov

from ...errors import CapacityError, UsageError
from ...kv.blocks import KVBlockManager, PriorityRange, Shares
from ...kv.paged_cache import HostTier, PagedKVCache, PoolPlan
from ...model.paged_rewrite import LOGITS_ROWS
from ..runner import ChunkHook, Runner
from .pools import PagedPools
from .tree_mask import TREE_MASK, mask_inputs, positions

#: retention priority of a chat's system prompt blocks (the manager's default is 35, max 100)
SYSTEM_PRIORITY = 90


class PagedRunner(Runner):
    """One PagedAttention infer request over the paged KV cache (:class:`PagedPools`): it runs
    the subsequences it is handed in one call (:meth:`run`, the scheduler's step) and, for a
    call that needs the model alone, one lone sequence (:meth:`prefill` / :meth:`step`, and
    :meth:`verify` / :meth:`truncate` for speculative decoding)."""

    def __init__(
        self,
        request: ov.InferRequest,
        *,
        capacity: int,
        max_prompt_len: int,
        chunk: int,
        prefix_reuse: bool = False,
        prefix_cache_tokens: int = 0,
        windows: Sequence[int | None] | None = None,
        host_tokens: int = 0,
        state_interval: int = 0,
        shares: Shares | None = None,
        shares_source: str = "kv_window_shares",
    ) -> None:
        """``capacity``: tokens one sequence may hold; ``prefix_cache_tokens``: room beyond it,
        so that earlier prompts' blocks stay cached while a sequence of full length runs.
        ``windows``: the attention window of each layer (None: full; default all full), whose
        block tables the model takes as ``block_table_input(window)``.  ``host_tokens``: the
        host tier, where blocks evicted from the pools go; ``shares`` (parsed, from the
        setting ``shares_source``): how the room and the host tier split between windows;
        ``state_interval``: a hybrid model's state checkpoints (:class:`PagedPools`)."""
        self.request = request
        names = {n for i in request.get_compiled_model().inputs for n in i.get_names()}
        self._rows_input = LOGITS_ROWS in names
        self.takes_trees = TREE_MASK in names  # verify(tokens, parents) checks a tree
        self.kv_binding = "paged"
        # the device writes every token's KV into the cache in place: the host copies none (only
        # a prefix hit on a sliding-window block a live sequence holds moves a block, and the
        # host tier's offloads and restores: PagedPools.moved_bytes)
        self.prefill_copied_bytes = self.switch_copied_bytes = 0
        self.capacity = capacity
        self.max_prompt_len = max_prompt_len
        self.chunk = chunk
        self.prefix_reuse = prefix_reuse
        self.memory = PagedPools(
            request,
            capacity=capacity,
            chunk=chunk,
            windows=windows,
            room=prefix_cache_tokens,
            host_tokens=host_tokens,
            state_interval=state_interval,
            shares=shares,
            shares_source=shares_source,
        )
        self._seq = 0  # id of the live lone sequence; 0: none yet
        self.reused_tokens = 0  # of the lone path's last prompt (the scheduler counts its own)
        self._dirty = False  # a call failed part-way and the manager was not rebuilt yet
        # tokens at the start of the next prompt kept at SYSTEM_PRIORITY (hold_prefix)
        self._held = self.held_tokens = 0
        # u8 blocks written one token at a time get other scales than a fresh prefill writes:
        # generated tokens' blocks are cached only for float KV, where they are the same
        self.stores_generated = self.cache.precision in ("f32", "f16", "bf16")

    # the memory's parts, as the pipeline, beam search and the tests read them
    @property
    def cache(self) -> PagedKVCache:  # type: ignore[override]
        return self.memory.cache

    @property
    def blocks(self) -> KVBlockManager:
        return self.memory.blocks

    @property
    def host(self) -> HostTier:
        return self.memory.host

    @property
    def pools(self) -> PoolPlan:
        return self.memory.plan

    def set_window_shares(self, value: object, source: str = "kv_window_shares") -> str | None:
        """Split the prefix-cache room and the host tier between the window pools anew (None:
        the default split); the cached prefixes are dropped.  Bad shares raise a ValueError
        naming ``source`` with nothing changed.  Returns the shares' canonical text."""
        canonical = self.memory.set_window_shares(value, source)  # a new, empty manager
        self.reused_tokens = 0
        return canonical

    def size_cache(self, nbytes: int, source: str) -> None:
        """The cache in ``nbytes`` (genai's ``SchedulerConfig.cache_size``): what one sequence
        needs and, as prefix-cache room, the tokens the rest holds over every layer.  Fewer
        bytes than one sequence needs raise a ``UsageError`` naming ``source``."""
        per_token, size = self.cache.bytes_per_token(), self.cache.block_size
        # whole blocks, none past the bytes given
        room = (nbytes // per_token // size - -(-self.capacity // size)) * size
        if room < 0:
            need = -(-self.capacity * per_token // 2**30)
            raise UsageError(
                f"{source} holds {nbytes // per_token} tokens of this model's KV, fewer than one "
                f"sequence's {self.capacity}: give at least {need} GB or lower max_prompt_len / "
                "min_response_len"
            )
        self.memory.set_room(room)
        self.reused_tokens = 0

    def hold_prefix(self, tokens: int) -> None:
        """Keep the next prompt's first ``tokens`` tokens (a chat's system prompt), in whole
        blocks, at SYSTEM_PRIORITY: evicted after every other cached block."""
        self._held = max(0, int(tokens))

    # -- state -------------------------------------------------------------------------------
    @property
    def shared_weights(self) -> bool:
        return True  # one compiled model runs both phases

    @property
    def host_bytes_copied(self) -> int:
        return self.memory.moved_bytes

    @property
    def tokens_in_cache(self) -> int:
        """Tokens of the live lone sequence (prompt and fed answer) whose KV the cache holds;
        0 with none live (the scheduler's sequences are its own: ``StepStats``)."""
        if self._seq in self.blocks.sequence_ids:
            return self.blocks.num_tokens(self._seq)
        return 0

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
        return {**super().stats(), **self.memory.stats(), "priority_held_tokens": self.held_tokens}

    # -- phases ------------------------------------------------------------------------------
    def release(self) -> None:
        """End the lone sequence of :meth:`prefill` / :meth:`step`, if one is live: its full
        blocks stay cached (the scheduler runs its own sequences)."""
        if self._seq in self.blocks.sequence_ids:
            self.blocks.remove_sequence(self._seq)

    def forget_prefixes(self) -> None:
        """An empty manager over the same pools (no sequence may be live)."""
        self.release()
        if self.blocks.sequence_ids:
            raise AssertionError("cached prefixes dropped while sequences are live")
        self.memory.blocks = self.memory.new_manager()
        self.reused_tokens = 0

    def fit_batch(self, sequences: int, tokens: int, step_tokens: int | None = None) -> bool:
        """Pools that hold ``sequences`` sequences of up to ``tokens`` tokens at once, steps of
        at most ``step_tokens`` (:meth:`PagedPools.fit_batch`: allocated anew when no sequence
        is live, the cached prefixes dropped; grown keeping every block when some are)."""
        if self.memory.fit_batch(sequences, tokens, step_tokens):
            self.reused_tokens = 0
            return True
        return False

    def run(
        self,
        parts: Sequence[tuple[Hashable, np.ndarray, int]],
        rows: int | Sequence[int] = 1,
        per_token: bool = False,
        parents: Sequence[int] | None = None,
    ) -> np.ndarray:
        """One call over the new tokens of several sequences, a subsequence each: ``parts``
        are ``(sequence, its new ids, tokens it has cached)``.  The logits of each part's last
        ``rows`` tokens (one count for all, or one per part), in order (the model's LM head
        runs on those only); where the model keeps the head on every token
        (``full_prefill_logits``), every token's.  The array is the request's own: copy what
        must outlive the next call.  ``per_token``: a hybrid model keeps the state after each
        token apart (a speculative verify, which :meth:`truncate` may cut back).  ``parents``
        (one part only): its tokens are a tree, each attending to the cache and its ancestors
        (``runtime/paged/tree_mask.py``)."""
        lengths = [int(ids.size) for _, ids, _ in parts]
        pasts = [past for _, _, past in parts]
        totals = [past + n for past, n in zip(pasts, lengths, strict=True)]
        ends = np.cumsum(lengths)
        blocks = [self.cache.blocks_for(total) for total in totals]
        seqs = [seq for seq, _, _ in parts]
        tables = {
            name: np.concatenate(
                [self.memory.table(seq, key, n) for seq, n in zip(seqs, blocks, strict=True)]
            )
            for key, name in self.memory.table_inputs.items()
        }
        inputs = {
            "input_ids": np.concatenate([np.asarray(ids, np.int64) for _, ids, _ in parts]),
            "position_ids": positions(pasts, lengths, parents),
            "past_lens": np.array(pasts, np.int32),
            "subsequence_begins": np.concatenate([[0], ends]).astype(np.int32),
            "block_indices_begins": np.concatenate([[0], np.cumsum(blocks)]).astype(np.int32),
            "max_context_len": np.array(max(totals), np.int32),
            **tables,
            **self.memory.state_paging(
                [(seq, past, n) for (seq, _, past), n in zip(parts, lengths, strict=True)],
                per_token,
            ),
        }
        if self.takes_trees:
            inputs.update(mask_inputs(len(parts), parents))
        if self._rows_input:
            counts = [rows] * len(parts) if isinstance(rows, int) else list(rows)
            inputs[LOGITS_ROWS] = np.concatenate(
                [
                    np.arange(end - min(r, n), end)
                    for end, n, r in zip(ends, lengths, counts, strict=True)
                ]
            ).astype(np.int64)
        self.request.infer(inputs, share_outputs=True)  # read below: no copy of the logits
        logits = self.request.get_tensor("logits").data
        return logits.reshape(-1, logits.shape[-1])

    def last_logits(self, parts: Sequence[tuple[Hashable, np.ndarray, int]]) -> np.ndarray:
        """:meth:`run` with one logits row per part, its last token's (the scheduler's step).
        The rows are the request's own output, valid until the next call."""
        logits = self.run(parts)
        if not self._rows_input:  # full logits (perplexity mode): each part's last row
            logits = logits[np.cumsum([ids.size for _, ids, _ in parts]) - 1]
        return logits

    def rows_logits(
        self, parts: Sequence[tuple[Hashable, np.ndarray, int]], rows: Sequence[int]
    ) -> np.ndarray:
        """:meth:`run` with each part's last ``rows[i]`` rows (a step where some sequence
        scores its prompt: every row of its chunk), concatenated in order; the request's own
        output where the head gathered them, valid until the next call."""
        logits = self.run(parts, rows)
        if not self._rows_input:  # full logits: pick the rows
            ends = np.cumsum([ids.size for _, ids, _ in parts])
            logits = logits[
                np.concatenate([np.arange(e - r, e) for e, r in zip(ends, rows, strict=True)])
            ]
        return logits

    def _infer(
        self,
        ids: np.ndarray,
        past: int,
        rows: int = 1,
        per_token: bool = False,
        parents: Sequence[int] | None = None,
    ) -> np.ndarray:
        """The lone sequence's call: ``[rows, vocab]`` (``[n, vocab]`` with full logits)."""
        return self.run([(self._seq, ids, past)], rows, per_token, parents)

    def prefill(self, ids: np.ndarray, on_chunk: ChunkHook | None = None) -> np.ndarray:
        """Run ``ids`` in chunks after the longest cached prefix; return the last logits.

        Chunks end where a fresh run's do (multiples of C), so every block is written in the
        same calls as in a fresh run: a u8 block's scales depend on that.
        ``on_chunk(positions, logits)`` as in :meth:`StaticRunner.prefill`, with every row of
        each chunk (the head gathers them); the prompt is then run whole, no prefix reused.
        """
        ids = np.asarray(ids, np.int64).reshape(-1)
        self.check_prompt(ids.size)
        with self.writing():
            if self._seq in self.blocks.sequence_ids:
                self.blocks.remove_sequence(self._seq)  # its full blocks stay cached for reuse
            self._seq += 1
            prompt = ids.tolist()
            # whole blocks, >= 1 token left to run
            reuse = self.prefix_reuse and on_chunk is None  # every row wanted: none cached
            start = self.blocks.lookup(prompt).hit_tokens if reuse else 0
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
                        self._seq, prompt[:end], priority, reuse=reuse
                    )
                    if reused != start:  # the device is told `start` tokens are cached
                        raise RuntimeError(f"block manager reused {reused} tokens, not {start}")
                else:
                    self.blocks.add_tokens(self._seq, prompt[begin:end])
                logits = self._infer(ids[begin:end], begin, 1 if on_chunk is None else end - begin)
                if on_chunk is not None:
                    positions = np.arange(begin, end)[-logits.shape[0] :]
                    on_chunk(positions, logits)
        return logits[-1].copy()

    def step(self, token: int) -> np.ndarray:
        """Feed one token, write its KV into the next slot, return the next logits."""
        if self.remaining_capacity <= 0:
            raise CapacityError.cache_full(self.capacity)
        past = self.tokens_in_cache
        with self.writing():
            self.blocks.add_token(self._seq, int(token), store=self.stores_generated)
            logits = self._infer(np.array([token], np.int64), past)
        return logits[-1].copy()

    # -- speculative decoding: several tokens checked in one call, the rejected ones dropped --
    def verify(self, tokens: Sequence[int], parents: Sequence[int] | None = None) -> np.ndarray:
        """Feed ``tokens`` as one chunk; the logits after each of them, ``[n, vocab]``.

        Row i predicts the token after ``tokens[i]``: a speculative decoder compares it with
        candidate i + 1.  The KV of every token is written, in the call's order; :meth:`truncate`
        drops what the decoder rejects.  ``parents``: a tree (:mod:`.tree_mask`; the model must
        take trees, :attr:`takes_trees`)."""
        ids = np.asarray(tokens, np.int64).reshape(-1)
        if not 0 < ids.size <= self.chunk:
            raise ValueError(f"verify takes 1 to {self.chunk} tokens, got {ids.size}")
        if parents is not None and not self.takes_trees:
            raise ValueError("this paged model takes no tree mask (built without tree_mask)")
        if self.remaining_capacity < ids.size:
            raise CapacityError.cache_full(self.capacity)
        past = self.tokens_in_cache
        with self.writing():
            self.blocks.add_tokens(self._seq, ids.tolist(), store=self.stores_generated)
            logits = self._infer(ids, past, rows=int(ids.size), per_token=True, parents=parents)
        return logits[-ids.size :].copy()

    def truncate(self, length: int) -> None:
        """Keep the KV of the sequence's first ``length`` tokens (at least the prompt's).  The
        manager releases the blocks past it and takes every block no longer full out of the
        reuse tree, so no rejected token's row is ever reused; the slots are overwritten by
        the next call."""
        if length < self.tokens_in_cache:  # the manager checks all before changing anything
            self.blocks.truncate(self._seq, length)

    @contextmanager
    def writing(self) -> Iterator[None]:
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
        self.memory.blocks = self.memory.new_manager()
        self.reused_tokens = 0
        self._dirty = False
