"""The live beams of a beam search as sequences of the paged runner's block manager.

After the prompt is prefilled once, every beam is a manager sequence whose block table starts
with the prompt's full blocks, shared through the manager's reuse tree (reference counts), not
copied.  A beam forked from another takes the shared full blocks the same way and gets its own
copy of the blocks the tree does not hold (the partial last block, and generated blocks that
are not stored): copy-on-write where two beams part, since each must write its next token
into its own last block.  A step feeds every live beam's token in ONE PagedAttention call, one
subsequence per beam, and returns one logits row per beam.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence

import numpy as np

from .runner import PagedRunner

_NEEDS_PAGED = (
    "num_beams > 1 needs the PagedAttention path (the CPU default, attention_backend='pa'); "
    "the static-shape path (NPU, attention_backend='sdpa') runs one sequence per call"
)


def beam_runner(runner: object) -> PagedRunner:
    """The paged runner behind ``runner`` (which may be a timing wrapper), or a
    ``ValueError`` naming ``num_beams`` when beams cannot run on it."""
    real = getattr(runner, "_runner", runner)
    if not isinstance(real, PagedRunner):
        raise ValueError(_NEEDS_PAGED)
    if real.memory.windowed:
        raise ValueError("num_beams > 1 is not supported for sliding-window models yet")
    return real


class BeamCache:
    """Beam sequences over one :class:`PagedRunner` whose prompt was just prefilled."""

    def __init__(self, runner: PagedRunner) -> None:
        self.runner = runner
        self.blocks = runner.blocks
        self.root: Hashable = runner._seq  # the prompt, the first beam's sequence
        self._ids = itertools.count()
        self.copied_bytes = 0
        self.peak_blocks = 0  # distinct blocks the live beams held at most (accounting)
        self._beams: list[Hashable] = [self.root]

    def new_id(self) -> Hashable:
        return ("beam", next(self._ids))

    def step(self, parents: Sequence[Hashable], tokens: Sequence[int]) -> list[Hashable]:
        """Child i continues sequence ``parents[i]`` with ``tokens[i]``.  A parent with no
        child is dropped (its full blocks stay cached), one with several is forked.  Returns
        the children's sequence ids, in order; :meth:`infer` then runs them."""
        kids = set(parents)
        live = set(self.blocks.sequence_ids)
        for seq in list(self._beams):
            if seq not in kids and seq in live:
                self.blocks.remove_sequence(seq)
        self._beams = []
        used: set[Hashable] = set()
        for parent in parents:
            if parent in used:
                child = self.new_id()
                self._fork(parent, child)
            else:
                child = parent
                used.add(parent)
            self._beams.append(child)
        for child, token in zip(self._beams, tokens, strict=True):
            self.blocks.add_token(child, int(token), store=self.runner._store_steps)
        tables = [self.blocks.block_table(s, self.runner.capacity) for s in self._beams]
        self.peak_blocks = max(self.peak_blocks, len({b for t in tables for b in t}))
        return list(self._beams)

    def _fork(self, parent: Hashable, child: Hashable) -> None:
        """``child`` gets ``parent``'s tokens: the full blocks the reuse tree holds are shared,
        the others (its partial last block at least) are copied."""
        tokens = self.blocks._get(parent).tokens
        hit = self.blocks.add_sequence(child, tokens, reuse=True, max_hit_tokens=len(tokens))
        key = self.runner.capacity
        src = self.blocks.block_table(parent, key)
        dst = self.blocks.block_table(child, key)
        for i in range(hit // self.runner.cache.block_size, len(dst)):
            if src[i] != dst[i]:
                for name in self.runner.memory.names[key]:
                    data = self.runner.cache.tensors[name].data
                    data[dst[i]] = data[src[i]]
                    self.copied_bytes += data[dst[i]].nbytes

    def infer(self, tokens: Sequence[int]) -> np.ndarray:
        """Run the live beams' newest tokens (one subsequence each) in one call; the logits
        ``[beams, vocab]``, row i for beam i."""
        parts = [
            (s, np.array([token], np.int64), self.blocks.num_tokens(s) - 1)
            for s, token in zip(self._beams, tokens, strict=True)
        ]
        return self.runner.run(parts).copy()  # one token each: one row each

    def close(self) -> None:
        """Forget the beams: their full blocks stay cached (the prompt's for the next call);
        the runner holds no live sequence afterwards.  The copies are counted as host copies."""
        for seq in list(self.blocks.sequence_ids):
            self.blocks.remove_sequence(seq)
        self.runner.memory.moved_bytes += self.copied_bytes
        self.runner.beam_peak_blocks = self.peak_blocks
        self.runner.beam_copied_bytes = self.copied_bytes
        self._beams = []
