"""The episodes of the random driver: a drawn layout and settings, and their config.

Layouts have >= 3 window sizes (2-3 sliding windows, usually with full attention) and pools
sized from the budget check's own bound (``min_live_blocks``) times 1-3, plus 0-3 spare blocks,
so blocks cycle between owners; host pools range from one block for the smallest window to
twice the primary pools.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from npuw_kv.kv.blocks import BlockManagerConfig, uniform_layers
from npuw_kv.kv.blocks.sequence import min_live_blocks

HEAD_DIM = 4  # 1 KV head, fp16, K and V: 16 bytes a token, one row of ``fuzz_shadow`` words


@dataclass
class Episode:
    """The drawn layout and settings of one manager."""

    tpb: int
    max_seq_len: int
    swa: list[int]
    full: bool
    chunk: int
    blocks: list[int]
    host_blocks: int
    default_priority: int
    offload_min_priority: int
    enable_reuse: bool
    external: bool
    vocab: int
    max_live: int
    ops: int

    @property
    def windows(self) -> list[int]:
        return self.swa + [self.max_seq_len] * self.full

    @staticmethod
    def draw(rng: random.Random, first: bool) -> Episode:
        if first:  # the plain hybrid layout: windows 4, 8 and full attention
            tpb, length, swa, full = 2, 32, [4, 8], True
            rng.random()  # keeps later draws aligned with the other episodes
        else:
            tpb, length = rng.choice([1, 1, 2, 2, 3, 4]), rng.randint(12, 48)
            full = rng.random() < 0.8
            swa = sorted(rng.sample(range(1, min(20, length - 1) + 1), 2 if full else 3))
        chunk = min(length, rng.choice([1, 2, 3, tpb, 2 * tpb, 8]))
        windows = swa + [length] * full
        mult = rng.choice([1, 1, 2, 3])
        blocks = [
            mult * min_live_blocks(length, w, tpb, chunk) + rng.choice([0, 0, 1, 3])
            for w in windows
        ]
        total = sum(blocks)
        tiny = -(-total // min(blocks))  # one host block for the smallest pool
        return Episode(
            tpb=tpb,
            max_seq_len=length,
            swa=swa,
            full=full,
            chunk=chunk,
            blocks=blocks,
            host_blocks=rng.choice([1, tiny, 2 * tiny, max(1, total // 3), total, 2 * total]),
            default_priority=35 if first else rng.choice([0, 35, 35, 60, 100]),
            offload_min_priority=35 if first else rng.choice([0, 35, 35, 60, 100]),
            enable_reuse=first or rng.random() < 0.93,
            external=rng.random() < 0.5,
            vocab=rng.randint(2, 4),
            max_live=rng.choice([2, 3, 4, 6]),
            ops=rng.randint(300, 1500),
        )

    def config(self) -> BlockManagerConfig:
        bb = 2 * HEAD_DIM * 2 * self.tpb  # block bytes: K+V, fp16
        total = sum(self.blocks)
        return BlockManagerConfig(
            layers=uniform_layers([*self.swa, *[None] * self.full], 1, HEAD_DIM),
            max_seq_len=self.max_seq_len,
            kv_budget_bytes=total * bb + bb // 2,
            host_budget_bytes=self.host_blocks * bb + bb // 2,
            tokens_per_block=self.tpb,
            window_size_shares=[b / total for b in self.blocks],
            enable_reuse=self.enable_reuse,
            default_priority=self.default_priority,
            offload_min_priority=self.offload_min_priority,
            max_tokens_per_call=self.chunk,
        )
