"""Prefill chunks and generate steps of a PagedAttention model over one paged KV cache.

The same infer request runs both phases: a chunk of the prompt or one generated token, the
number of tokens already cached (``past_lens``) and the block table of the one sequence.  The
device writes each token's KV into its slot of the cache tensors bound once at start, so
nothing is copied, ever: not per chunk, not at the prefill -> generate switch.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import openvino as ov

from ..kv.paged import PagedKVCache, PagedSpec
from ..model.paged import cache_inputs
from .engine import CapacityError, shared_prefix


class PagedRunner:
    kv_binding = "paged"
    shared_weights = True  # one compiled model runs both phases
    # the device writes every token's KV into the cache in place: the host never copies any
    host_bytes_copied = prefill_copied_bytes = switch_copied_bytes = 0

    def __init__(
        self,
        request: ov.InferRequest,
        capacity: int,
        max_prompt_len: int,
        chunk: int,
        prefix_reuse: bool = False,
    ) -> None:
        self.request = request
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
        block_size = next(s.block_shape[1] for s in specs if s.name.startswith("value_cache."))
        self.cache = PagedKVCache(specs, capacity, block_size)
        for name, tensor in self.cache.tensors.items():
            request.set_tensor(name, tensor)
        self._cached: list[int] = []  # token ids whose KV the cache holds, in slot order
        self.reused_tokens = 0

    # -- state -------------------------------------------------------------------------------
    @property
    def tokens_in_cache(self) -> int:
        return len(self._cached)

    @property
    def remaining_capacity(self) -> int:
        """How many more tokens can be generated before the KV cache is full."""
        return self.cache.capacity - len(self._cached)

    # -- phases ------------------------------------------------------------------------------
    def _infer(self, ids: np.ndarray, past: int) -> np.ndarray:
        n, total = int(ids.size), past + int(ids.size)
        blocks = self.cache.blocks_for(total)
        self.request.infer(
            {
                "input_ids": ids,
                "position_ids": np.arange(past, total, dtype=np.int64),
                "past_lens": np.array([past], np.int32),
                "subsequence_begins": np.array([0, n], np.int32),
                "block_indices_begins": np.array([0, blocks], np.int32),
                "block_indices": np.arange(blocks, dtype=np.int32),
                "max_context_len": np.array(total, np.int32),
            }
        )
        logits = self.request.get_tensor("logits").data
        return logits.reshape(-1, logits.shape[-1])  # [1, vocab], or [n, vocab] (full logits)

    def prefill(
        self, ids: np.ndarray, on_chunk: Callable[[np.ndarray, np.ndarray], None] | None = None
    ) -> np.ndarray:
        """Run ``ids`` in chunks after the cached prefix it shares; return the last logits.

        ``on_chunk(positions, logits)`` as in :meth:`StaticRunner.prefill`.
        """
        ids = np.asarray(ids, np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("prompt is empty: at least one token is needed")
        if ids.size > self.max_prompt_len:
            raise CapacityError.prompt(ids.size, self.max_prompt_len)
        start = self._common_prefix(ids)
        self._cached = self._cached[:start]
        logits = np.empty((1, 0), np.float32)
        for begin in range(start, ids.size, self.chunk):
            part = ids[begin : begin + self.chunk]
            try:
                logits = self._infer(part, begin)
            except Exception:
                self._cached = []  # a failure part-way leaves the cache in no state to reuse
                raise
            self._cached.extend(part.tolist())
            if on_chunk is not None:
                positions = np.arange(begin, begin + part.size)[-logits.shape[0] :]
                on_chunk(positions, logits)
        self.reused_tokens = start
        return logits[-1].copy()

    def _common_prefix(self, ids: np.ndarray) -> int:
        """Cached tokens this prompt keeps: the shared prefix, in whole blocks.

        At least one token must run (for logits).  Whole blocks because a u8 block's scales
        depend on which of its tokens were written together: rerunning the partial block from
        its start writes it as a fresh run would.  Kept blocks that a fresh run would write
        differently (generated tokens, written one by one) stay as they are, so after a chat
        turn a u8 continuation is close to a fresh prefill, not bit-equal; f32 KV is exact.
        """
        if not self.prefix_reuse:
            return 0
        block = self.cache.block_size
        return shared_prefix(self._cached, ids) // block * block

    def step(self, token: int) -> np.ndarray:
        """Feed one token, write its KV into the next slot, return the next logits."""
        if self.remaining_capacity <= 0:
            raise CapacityError.cache_full(self.cache.capacity)
        logits = self._infer(np.array([token], np.int64), len(self._cached))
        self._cached.append(int(token))
        return logits[-1].copy()
