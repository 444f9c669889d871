"""The static shapes of the KV buffer and of the models that read it: the prefill chunk, the
past each prefill / generate model reads (the pyramid ladders), where the buffer is cut into
blocks, and which sliding-window layers keep a ring.  Pure arithmetic: the graph side
(:mod:`npuw_kv.model.variants`) reshapes models to these, the runtime binds them."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import combinations

from .slots import pieces, plan_rings

# the generate variants' KV lengths grow in steps of this many tokens (doubling), as NPUW's
GENERATE_STEP = 1024


@dataclass(frozen=True)
class StaticShapes:
    """The static-shape path's fixed sizes, from which every model shape and view follows: the
    prefill chunk, the prompt and KV lengths, and which variants and rings exist.  Frozen: the
    compiled models were reshaped to exactly these, so they cannot change after compiling."""

    chunk: int  # C: tokens per prefill chunk
    max_prompt_len: int  # prefill attention_mask length (multiple of C)
    total_len: int  # KV capacity: MAX_PROMPT_LEN + MIN_RESPONSE_LEN
    pyramid: bool = False  # prefill variants by past length (see prefill_pasts)
    generate_variants: bool = False  # generate variants by KV length (see generate_pasts)
    # only the variants that pay for their memory (the "auto" defaults; see the two ladders)
    lean_pyramid: bool = False
    lean_generate: bool = False
    window_rings: bool = False  # sliding-window layers' KV in rings (model/ring.py)
    # the KV buffer cut into blocks where the models' pasts end (see block_edges)
    dense_blocks: bool = False

    def rings(self, windows: tuple[int | None, ...]) -> tuple[tuple[int, int], ...]:
        """``(window, slots)`` of the windows whose layers keep their KV in a ring."""
        return plan_rings(windows, self.chunk, self.generate_past) if self.window_rings else ()

    @property
    def prefill_past(self) -> int:
        return self.max_prompt_len - self.chunk

    @property
    def generate_past(self) -> int:
        return self.total_len - 1

    @property
    def prefill_pasts(self) -> tuple[int, ...]:
        """Past lengths of the prefill models, ascending; the last is the whole prefill past.

        Pyramid: 0, C, 2C, 4C, ... (doubling) below the whole past.  A chunk starting at slot
        s runs on the smallest past >= s, so it attends over at most twice the slots it needs
        (every multiple of C would need fewer attention rows, but each model costs its compiled
        code and buffers: 16 models at 4k/256 against 7; docs/measurements.md).
        """
        if not self.pyramid:
            return (self.prefill_past,)
        if self.lean_pyramid:
            # two static models more than one per phase, in all (each costs a share of the
            # static path's peak RSS; docs/measurements.md): where a generate variant takes one
            # (from ~2k), one prefill model; else (1k) two
            rungs = 1 if len(self.generate_pasts) > 1 else 2
            c = self.chunk
            return (*(k * c for k in lean_rungs(self.prefill_past // c, rungs)), self.prefill_past)
        pasts, past = [0], self.chunk
        while past < self.prefill_past:
            pasts.append(past)
            past *= 2
        # the widest step, from the last doubling to the whole past, gets its midpoint when
        # at least 4 chunks apart (at 4k/256: 2048 -> 3072 -> 3840)
        gap = self.prefill_past - pasts[-1]
        if gap >= 4 * self.chunk:
            pasts.append(pasts[-1] + -(-gap // 2 // self.chunk) * self.chunk)
        return tuple(sorted({*pasts, self.prefill_past}))

    @property
    def generate_pasts(self) -> tuple[int, ...]:
        """KV lengths the generate models read, ascending; the last is the whole buffer.

        Like NPUW's ``NPUW_LLM_GENERATE_PYRAMID``: room for 1024, 2048, 4096, ... prompt
        tokens plus the response (MIN_RESPONSE_LEN), then the whole capacity.
        """
        if not self.generate_variants:
            return (self.generate_past,)
        response = self.total_len - self.max_prompt_len
        pasts, prompt = [], GENERATE_STEP
        while prompt + response - 1 < self.generate_past:
            pasts.append(prompt + response - 1)
            prompt *= 2
        if self.lean_generate:  # the smallest only: short contexts gain most per model
            pasts = pasts[:1]
        if self.dense_blocks:  # whole chunks: a block edge there splits no chunk of a prompt
            whole = (-(-p // self.chunk) * self.chunk for p in pasts)
            pasts = sorted({min(p, self.generate_past - 1) for p in whole})
        return (*pasts, self.generate_past)

    @cached_property  # past_blocks reads it once per model; it re-derives both ladders
    def block_edges(self) -> tuple[int, ...]:
        """Where the KV buffer's blocks meet (``SharedKVCache.edges``): every model's past
        short of the whole buffer, so that each model reads whole blocks, dense, not a strided
        view of the buffer (NPUW on the CPU copies a strided past before every call, a share of
        every step's time; docs/measurements.md).  Empty unless
        ``dense_blocks``."""
        if not self.dense_blocks:
            return ()
        pasts = {*self.prefill_pasts, *self.generate_pasts}
        return tuple(sorted(p for p in pasts if 0 < p < self.generate_past))

    def past_blocks(self, past: int) -> tuple[int, ...]:
        """The lengths of the blocks a model of ``past`` slots reads, in order (one: the past
        is a single input)."""
        return tuple(b - a for a, b, _ in pieces(0, past, edges=self.block_edges))


def lean_rungs(whole: int, count: int) -> tuple[int, ...]:
    """Where ``count`` prefill models below the whole past (``whole`` chunks) go, in chunks.

    A prompt that fills MAX_PROMPT_LEN runs chunk i (i = 0..whole) on the smallest model whose
    past holds i chunks, and its attention reads that model's whole past.  These are the
    ``count`` pasts that minimise the slots all its chunks read; of equal sums the lowest, which
    also serve shorter prompts with less.  (At 4k / 256 one model at 7 chunks, 1792: every
    prompt length reads fewer slots than with one at half the past, 2048.)
    """

    def slots(rungs: tuple[int, ...]) -> int:
        total, below = 0, -1
        for past in (*rungs, whole):  # chunks below+1 .. past run on the model of this past
            total += (past - below) * past
            below = past
        return total

    count = min(count, whole)
    return min(combinations(range(whole), count), key=lambda rungs: (slots(rungs), rungs))
