"""Many sequences in one PagedAttention call: the paged path's scheduler.

Every live sequence is a sequence of the runner's block manager, so prefix reuse, eviction and
the per-window pools serve them all.  Each :meth:`Scheduler.step` is one ``infer`` whose
subsequences are the sequences' next tokens: one token for each sequence that is decoding,
then prefill chunks of the sequences still reading their prompt, as far as the token budget
(``max_num_batched_tokens``) goes; at most ``max_num_seqs`` sequences hold blocks at a time and
the others wait.  A prompt's chunks end where a lone run's do (multiples of the chunk), unless
the budget is smaller than a chunk.

When the pools run out of blocks, the newest sequence is preempted: its blocks go back to the
manager (its full blocks stay cached) and it waits, keeping its tokens, to be run again from
the longest cached prefix (recompute, as vLLM does).  When no sequence can run at all (the
pools a user sized hold the admitted sequences, none of which has a token to run: the beams of
a search waiting for each other), a step raises :class:`OutOfRoom`, naming the sequences that
hold blocks; the caller ends their requests with what they generated, as genai does when it
is out of memory.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import CapacityError, UsageError
from ...kv.blocks import OutOfBlocksError, PriorityRange
from .runner import SYSTEM_PRIORITY, PagedRunner


class OutOfRoom(RuntimeError):
    """No sequence could run in the pools: ``holding`` are the handles of the sequences that
    hold blocks (the waiting one that could not be admitted when none does)."""

    def __init__(self, holding: list[int]) -> None:
        super().__init__(
            "no sequence could run: the KV pools hold none of them (num_kv_blocks / "
            "cache_size too small for the requests together)"
        )
        self.holding = holding


@dataclass
class StepStats:
    """What the scheduler's steps did, for ``kv_stats()``: steps run, the most sequences in
    one, preemptions; the latest admitted prompt's reused and priority-held tokens; the
    computed tokens of the last sequence finished; the last beam search's most distinct KV
    blocks held at once and the bytes its copy-on-write forks moved.  ``latest``: a batched
    prompt is the pipeline's last one (the running batch clears it when a call takes the runner
    alone or the adapters change)."""

    steps: int = 0
    peak_batch: int = 0
    preemptions: int = 0
    reused_tokens: int = 0
    held_tokens: int = 0
    finished_tokens: int = 0
    beam_peak_blocks: int = 0
    beam_copied_bytes: int = 0
    latest: bool = False

    def prompt_admitted(self, reused: int, held: int) -> None:
        self.reused_tokens, self.held_tokens, self.latest = reused, held, True

    def report(self) -> dict[str, int]:
        """The keys of ``Runner.stats`` these figures replace while ``latest``, and the beam
        figures."""
        out = {
            "beam_peak_blocks": self.beam_peak_blocks,
            "beam_copied_bytes": self.beam_copied_bytes,
        }
        if self.latest:
            out.update(
                reused_tokens=self.reused_tokens,
                priority_held_tokens=self.held_tokens,
                tokens_in_cache=self.finished_tokens,
            )
        return out


@dataclass
class Live:
    """One sequence of the scheduler: its tokens (prompt and fed answer; the last one's logits
    are what it waits for) and how many of them the cache holds."""

    handle: int
    tokens: list[int]
    prompt_len: int
    held: int = 0  # leading tokens kept at SYSTEM_PRIORITY (a chat's system prompt)
    key: Hashable = None  # its block-manager sequence while admitted
    computed: int = 0
    preemptions: int = 0
    given: int = -1  # its tokens when its last logits were handed out (it may be fed then)
    # echo with logprobs: the prompt's scores (generation.prompt_scores.PromptScores), filled
    # from every row of its prompt's chunks; its prompt is read whole, no cached prefix used
    scores: Any = None

    @property
    def scoring(self) -> bool:
        return self.scores is not None and not self.scores.complete

    @property
    def admitted(self) -> bool:
        return self.key is not None

    @property
    def reading_prompt(self) -> bool:
        """More than one token to run: a prompt (or a preempted sequence) being read."""
        return len(self.tokens) - self.computed > 1

    @property
    def waiting_for_logits(self) -> bool:
        return self.computed < len(self.tokens)


class Scheduler:
    """Sequences submitted, fed and finished between steps over one :class:`PagedRunner`:
    which of them run in the next call, how many of their tokens, and whose blocks go back
    when the pools run out (the runner only runs the subsequences it is handed)."""

    def __init__(
        self,
        runner: PagedRunner,
        max_num_seqs: int,
        max_batched_tokens: int | None = None,
        split_fuse: bool = True,
    ) -> None:
        """``split_fuse`` (genai's ``dynamic_split_fuse``): a step runs decode tokens and
        prompt chunks together; False: while a prompt is to be read, steps read prompts only
        (decoding waits), as genai's scheduler without it."""
        if max_num_seqs < 1:
            raise UsageError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.runner = runner
        self.max_num_seqs = max_num_seqs
        # a step of one chunk's tokens, decode tokens included: the CPU's kernels run a step of
        # exactly one chunk much faster than one a little longer (docs/measurements.md)
        self.budget = max_batched_tokens or runner.chunk
        self.split_fuse = split_fuse
        self._windowed = runner.memory.windowed
        if self.budget < 1:
            raise UsageError(f"max_num_batched_tokens must be >= 1, got {self.budget}")
        self.live: dict[int, Live] = {}
        self.waiting: deque[Live] = deque()
        self.scheduled: list[int] = []  # the sequences the last step ran
        self._handles = itertools.count()
        self._keys = itertools.count()
        self.stats = StepStats()
        runner.release()  # a lone sequence left over from an earlier call: cached, not live

    # -- the caller's side ----------------------------------------------------------------------
    def submit(self, tokens: list[int], held: int = 0, scores: Any = None) -> int:
        """A new sequence: ``tokens`` is its prompt, of which the first ``held`` (whole
        blocks of them) stay cached at SYSTEM_PRIORITY; it waits until there is room.
        ``scores`` (a ``PromptScores``): the prompt's rows are handed to its ``add``."""
        self.runner.check_prompt(len(tokens))
        block = self.runner.cache.block_size
        held = min(max(0, int(held)), len(tokens)) // block * block
        seq = Live(next(self._handles), list(tokens), len(tokens), held, scores=scores)
        self.live[seq.handle] = seq
        self.waiting.append(seq)
        return seq.handle

    def feed(self, handle: int, token: int) -> None:
        """The sequence's next token, chosen from the logits its last step gave."""
        seq = self.live[handle]
        if seq.given != len(seq.tokens):  # (preempted since, it is read again: that is fine)
            raise RuntimeError(f"sequence {handle} was fed before its logits came")
        if len(seq.tokens) >= self.runner.capacity:
            raise CapacityError.cache_full(self.runner.capacity)
        seq.tokens.append(int(token))

    def fork(self, handle: int) -> int:
        """A new sequence with ``handle``'s tokens (a beam parting from another), fed apart
        from then on.  Its KV comes from the block manager's fork (full blocks shared, the
        others copied), or, when the pools lack the blocks, it waits and is computed again."""
        parent = self.live[handle]
        if parent.given != len(parent.tokens):
            raise RuntimeError(f"sequence {handle} is forked between its token and its logits")
        child = Live(next(self._handles), list(parent.tokens), parent.prompt_len, parent.held)
        child.given = parent.given
        self.live[child.handle] = child
        if not parent.admitted:
            self.waiting.append(child)
            return child.handle
        key = ("batch", id(self), next(self._keys))
        try:
            self.runner.blocks.fork(parent.key, key)
        except OutOfBlocksError:
            self.waiting.appendleft(child)  # recomputed from its tokens when there is room
            return child.handle
        child.key, child.computed = key, parent.computed
        return child.handle

    @property
    def capacity(self) -> int:
        """Tokens one sequence may hold."""
        return self.runner.capacity

    def remaining(self, handle: int) -> int:
        """Tokens the sequence may still be fed before its KV room is full."""
        return self.runner.capacity - len(self.live[handle].tokens)

    def finish(self, handle: int) -> None:
        """The sequence is done: its blocks go back (its full blocks stay cached)."""
        seq = self.live.pop(handle)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.stats.finished_tokens = seq.computed  # kv_stats' tokens_in_cache
        self._release(seq)

    @property
    def busy(self) -> bool:
        return bool(self.live)

    # -- one step ----------------------------------------------------------------------------
    def step(self) -> dict[int, np.ndarray]:
        """Run one batched call; the next-token logits of each sequence that got them.  The
        rows are views of the request's output, which the next step overwrites: copy what
        must outlive it (a copy of every row costs a batch measurable time)."""
        with self.runner.writing():
            plan = self._schedule()
            if plan:
                parts = [(s.key, np.asarray(s.tokens[b:e], np.int64), b) for s, b, e in plan]
                if any(s.scoring for s, _, _ in plan):
                    logits = self._scored(plan, parts)
                else:
                    logits = self.runner.last_logits(parts)  # valid until the next step
        if not plan:  # nothing was registered: the cached blocks stay
            holding = [s.handle for s in self.live.values() if s.admitted]
            raise OutOfRoom(holding or [s.handle for s in list(self.waiting)[:1]])
        self.stats.steps += 1
        self.stats.peak_batch = max(self.stats.peak_batch, len(plan))
        self.scheduled = [seq.handle for seq, _, _ in plan]
        out: dict[int, np.ndarray] = {}
        for (seq, _, end), row in zip(plan, logits, strict=True):
            seq.computed = end
            if end == len(seq.tokens):
                seq.given = end
                out[seq.handle] = row
        return out

    def _scored(
        self, plan: list[tuple[Live, int, int]], parts: list[tuple[Any, np.ndarray, int]]
    ) -> np.ndarray:
        """A step in which some sequence scores its prompt: every row of its chunk is run
        through the head and handed to its scores; each part's last row returned."""
        rows = [e - b if s.scoring and b < s.prompt_len else 1 for s, b, e in plan]
        logits = self.runner.rows_logits(parts, rows)
        ends = np.cumsum(rows)
        for (seq, begin, end), count, stop in zip(plan, rows, ends, strict=True):
            if seq.scoring and begin < seq.prompt_len:
                seq.scores.add(np.arange(end - count, end), logits[stop - count : stop])
        return logits[ends - 1]

    def _schedule(self) -> list[tuple[Live, int, int]]:
        """The step's subsequences ``(sequence, begin, end)``, their blocks registered."""
        budget = self.budget
        plan: list[tuple[Live, int, int]] = []
        if self._windowed:  # a sequence that waits this step holds only what it will read
            for seq in self.live.values():
                if seq.admitted:
                    self.runner.blocks.detach_unseen(seq.key)
        running = [s for s in self.live.values() if s.admitted and s.waiting_for_logits]
        # decode tokens first (oldest first), then the prompts being read
        running.sort(key=lambda s: (s.reading_prompt, s.handle))
        if not self.split_fuse:  # prompts in steps of their own while there are any to read
            reading = [s for s in running if s.reading_prompt]
            admissible = self.waiting and self._admitted() < self.max_num_seqs
            if reading or admissible:
                running = reading
        for seq in running:
            if budget <= 0:
                break
            if not seq.admitted:  # preempted by an earlier sequence of this step
                continue
            end = self._chunk_end(seq, budget)
            if not self._grow(seq, end, plan):
                continue
            plan.append((seq, seq.computed, end))
            budget -= end - seq.computed
        while self.waiting and budget > 0 and self._admitted() < self.max_num_seqs:
            seq = self.waiting[0]
            start = self._hit(seq)
            end = self._chunk_end(seq, budget, start)
            try:
                key = ("batch", id(self), next(self._keys))
                priority = [PriorityRange(0, seq.held, SYSTEM_PRIORITY)] if seq.held else None
                reused = self.runner.blocks.add_sequence(
                    key,
                    seq.tokens[:end],
                    priority,
                    reuse=self.runner.prefix_reuse,
                    max_hit_tokens=start,
                )
            except OutOfBlocksError:
                break  # room comes back as the running sequences finish (else: OutOfRoom)
            if reused != start:
                self.runner.blocks.remove_sequence(key)
                raise RuntimeError(f"block manager reused {reused} tokens, not {start}")
            self.waiting.popleft()
            seq.key, seq.computed = key, start
            self.stats.prompt_admitted(start, seq.held)  # as a lone run accounts its prompt
            plan.append((seq, start, end))
            budget -= end - start
        return plan

    def restart(self) -> None:
        """After a step that did not end (interrupted in the model call, or between the call
        and the handing out of its logits): every live sequence is read again from its
        tokens, as a preempted one is, so none waits for logits that never came.  The runner
        has forgotten the blocks the step registered (``PagedRunner.writing``)."""
        for seq in sorted(self.live.values(), key=lambda s: s.handle, reverse=True):
            if seq.admitted or seq.computed:
                self._release(seq)
                if seq not in self.waiting:
                    self.waiting.appendleft(seq)
                seq.computed, seq.preemptions = 0, seq.preemptions + 1
                self.stats.preemptions += 1

    def _admitted(self) -> int:
        return sum(s.admitted for s in self.live.values())

    def _hit(self, seq: Live) -> int:
        """Tokens of ``seq`` the cache already holds (whole blocks, one token left to run)."""
        if not self.runner.prefix_reuse or seq.scoring:  # a scored prompt: every row is run
            return 0
        return int(self.runner.blocks.lookup(seq.tokens).hit_tokens)

    def _chunk_end(self, seq: Live, budget: int, start: int | None = None) -> int:
        """Where the next chunk of ``seq`` ends: the next multiple of the chunk size (as a
        lone run's chunks), its last token, or the budget, whichever comes first."""
        begin = seq.computed if start is None else start
        size = self.runner.chunk
        aligned = (begin // size + 1) * size
        return min(len(seq.tokens), aligned, begin + budget)

    def _grow(self, seq: Live, end: int, plan: list[tuple[Live, int, int]]) -> bool:
        """Register ``seq``'s tokens up to ``end`` with the manager, preempting the newest
        other sequences while the pools are full.  False: ``seq`` itself was preempted."""
        new = seq.tokens[seq.computed : end]
        # a prompt's blocks are stored for reuse; generated ones as a lone run stores them
        store = end <= seq.prompt_len or self.runner.stores_generated
        while True:
            try:
                self.runner.blocks.add_tokens(seq.key, new, store=store)
                return True
            except OutOfBlocksError:
                victim = self._victim(plan)
                if victim is None:
                    raise
                self._preempt(victim)
                if victim is seq:
                    return False

    def _victim(self, plan: list[tuple[Live, int, int]]) -> Live | None:
        """The newest admitted sequence not already in this step's plan."""
        planned = {id(s) for s, _, _ in plan}
        admitted = [s for s in self.live.values() if s.admitted and id(s) not in planned]
        return max(admitted, key=lambda s: s.handle) if admitted else None

    def _preempt(self, seq: Live) -> None:
        self._release(seq)
        seq.computed, seq.preemptions = 0, seq.preemptions + 1
        self.stats.preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Live) -> None:
        if seq.admitted and seq.key in self.runner.blocks.sequence_ids:
            self.runner.blocks.remove_sequence(seq.key)
        seq.key = None

    # -- what beam search asks of its sequences ------------------------------------------------
    @property
    def moved_bytes(self) -> int:
        """KV bytes the host moved so far (a fork's copy-on-write block copies among them)."""
        return self.runner.host_bytes_copied

    def distinct_blocks(self, handles: Sequence[int]) -> int:
        """How many distinct blocks of the full-attention pool (the widest window's, if none
        is full) the admitted sequences among ``handles`` hold together."""
        window = max(self.runner.pools.primary)
        keys = [self.live[h].key for h in handles if self.live[h].admitted]
        return len({b for k in keys for b in self.runner.blocks.block_table(k, window)})
