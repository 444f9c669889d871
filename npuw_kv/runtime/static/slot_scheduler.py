"""Many sequences on the static-shape path: which slot each sequence runs in, and what runs next.

The running batch (:mod:`npuw_kv.generation.running_batch`) drives this as it drives the paged
path's scheduler: sequences are submitted, fed and finished between steps.  Here a sequence gets
one of the slots (:mod:`.packed`: a region of the KV pool with its own runner) for its whole life,
waiting while none is free; a free slot keeps its last sequence's KV, so a new prompt goes to
the free slot that holds the longest prefix of it (a chat's next turn lands where its history
is) and runs only the rest.  A step is either one chunk of a prompt, through the prefill models,
or one token of every sequence that decodes, packed in one generate call.  While both wait, up
to ``CHUNKS_PER_DECODE`` chunks run between two decode steps: a packed step costs little more
for 16 rows than for 4, so sequences should join it in groups, yet the others' next token waits
for a few chunks only, not for a long prompt or the whole queue.  A slot never runs out of KV
room before its sequence reaches the static models' capacity (MAX_PROMPT_LEN +
MIN_RESPONSE_LEN), so nothing is preempted: sequences wait for a slot instead.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import CapacityError
from ..paged.scheduler import StepStats
from .packed import PackedSteps
from .runner import StaticRunner

# prompt chunks run one after another while others decode, before those get their next token:
# a decode step costs little more for 16 rows than for 1, so new sequences join it in groups
CHUNKS_PER_DECODE = 4


@dataclass
class SlotStats(StepStats):
    """The steps' figures, and the packed models': their sizes, the packed calls run and the
    sequence rows they stepped (their ratio: how full a packed call ran), the KV pool."""

    packed: PackedSteps | None = None

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(super().report())
        if self.packed is not None:
            out.update(
                packed_slots=[m.slots for m in self.packed.models],
                packed_steps=self.packed.steps,
                packed_rows=self.packed.rows,
                kv_pool_bytes=self.packed.pool.nbytes,
            )
        return out


@dataclass
class SlotSequence:
    """One sequence: its tokens (prompt and fed answer) and how many its slot holds."""

    handle: int
    tokens: list[int]
    prompt_len: int
    held: int = 0  # leading tokens a chat's system prompt holds (kept first for reuse)
    scores: Any = None  # echo with logprobs: every prompt row's logits (PromptScores)
    slot: int | None = None
    computed: int = 0
    given: int = -1  # its tokens when its last logits were handed out
    preemptions: int = 0
    reading: Iterator[np.ndarray | None] | None = None  # its prompt's chunks, being run

    @property
    def waiting_for_logits(self) -> bool:
        return self.computed < len(self.tokens)


class SlotScheduler:
    """Sequences in the slots of a :class:`PackedSteps` (module docstring)."""

    def __init__(self, steps: PackedSteps) -> None:
        self.steps = steps
        self.lanes: list[StaticRunner] = steps.lanes
        self.max_num_seqs = len(self.lanes)
        self.budget = self.lanes[0].chunk  # (the running batch sizes nothing by it here)
        self.live: dict[int, SlotSequence] = {}
        self.waiting: deque[SlotSequence] = deque()
        self.scheduled: list[int] = []
        self.stats = SlotStats(packed=steps)
        self.latest: StaticRunner = self.lanes[0]  # the slot whose prompt ran last
        self._handles = itertools.count()
        self._holder: dict[int, SlotSequence] = {}  # slot -> its live sequence
        self._chunks_run = 0  # prompt chunks run since the last decode step
        # prompt tokens read, and of them taken from a slot's KV (vLLM's prefix-cache counters)
        self.prompt_tokens = self.hit_tokens = 0

    # -- the caller's side ----------------------------------------------------------------------
    def submit(self, tokens: list[int], held: int = 0, scores: Any = None) -> int:
        self.lanes[0].check_prompt(len(tokens))
        seq = SlotSequence(next(self._handles), list(tokens), len(tokens), held, scores)
        self.live[seq.handle] = seq
        self.waiting.append(seq)
        return seq.handle

    def feed(self, handle: int, token: int) -> None:
        seq = self.live[handle]
        if seq.given != len(seq.tokens):
            raise RuntimeError(f"sequence {handle} was fed before its logits came")
        if self.remaining(handle) <= 0:
            raise CapacityError.cache_full(self.capacity)
        seq.tokens.append(int(token))

    def fork(self, handle: int) -> int:
        """A new sequence with ``handle``'s tokens (a beam parting): its slot's KV copied into
        a free slot, or, with none free, it waits and is read again from its tokens."""
        parent = self.live[handle]
        if parent.given != len(parent.tokens):
            raise RuntimeError(f"sequence {handle} is forked between its token and its logits")
        child = SlotSequence(next(self._handles), list(parent.tokens), parent.prompt_len)
        child.given = parent.given
        self.live[child.handle] = child
        free = self._free()
        if parent.slot is None or not free:
            self.waiting.appendleft(child)
            return child.handle
        self._take(child, free[0])
        self.lanes[free[0]].copy_from(self.lanes[parent.slot])
        child.computed = parent.computed
        return child.handle

    @property
    def capacity(self) -> int:
        """Tokens one sequence may hold (its prompt's front padding counts)."""
        return self.lanes[0].shapes.total_len

    def remaining(self, handle: int) -> int:
        seq = self.live[handle]
        if seq.slot is not None and seq.computed:
            runner = self.lanes[seq.slot]
            return runner.remaining_capacity - (len(seq.tokens) - seq.computed)
        chunk = self.lanes[0].chunk
        return self.capacity - len(seq.tokens) - (-seq.prompt_len % chunk)

    def finish(self, handle: int) -> None:
        seq = self.live.pop(handle)
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.reading = None  # a prompt cancelled part-way: its slot's KV is not kept for reuse
        self.stats.finished_tokens = seq.computed
        self._release(seq)

    @property
    def busy(self) -> bool:
        return bool(self.live)

    def forget_prefixes(self) -> None:
        """Every slot drops the KV it keeps for reuse (the model computes other KV now: other
        LoRA alphas); nothing may be live."""
        for lane in self.lanes:
            lane.forget_prefixes()

    @property
    def slots_held(self) -> int:
        """Slots a live sequence holds now."""
        return len(self._holder)

    @property
    def moved_bytes(self) -> int:
        return sum(lane.host_bytes_copied for lane in self.lanes)

    def distinct_blocks(self, handles: Sequence[int]) -> int:
        """Slots the sequences among ``handles`` hold (each its own region)."""
        return sum(self.live[h].slot is not None for h in handles)

    # -- one step ----------------------------------------------------------------------------
    def step(self) -> dict[int, np.ndarray]:
        """One prompt, or one token of every decoding sequence; the logits of each sequence
        that got them (valid until the next step)."""
        self._admit()
        running = [s for s in self.live.values() if s.slot is not None and s.waiting_for_logits]
        prompts = [s for s in running if s.computed == 0]
        decoding = [s for s in running if s.computed]
        if prompts and (self._chunks_run < CHUNKS_PER_DECODE or not decoding):
            # the prompt being read first, else the oldest
            seq = min(prompts, key=lambda s: (s.reading is None, s.handle))
            out = self._prompt(seq)
            self._chunks_run += 1
            self.scheduled = [seq.handle]
        elif decoding:
            out = self._decode(decoding)
            self._chunks_run = 0
            self.scheduled = list(out)
        else:
            out, self.scheduled = {}, []
        self.stats.steps += bool(self.scheduled)
        self.stats.peak_batch = max(self.stats.peak_batch, len(self.scheduled))
        return out

    def _prompt(self, seq: SlotSequence) -> dict[int, np.ndarray]:
        """The next chunk of ``seq``'s prompt (its logits after the last one)."""
        assert seq.slot is not None
        runner = self.lanes[seq.slot]
        ids = np.asarray(seq.tokens, np.int64)
        if seq.scores is not None and not seq.scores.complete:  # every row: read whole
            logits = runner.prefill_every_row(ids, seq.scores.add)
        else:
            if seq.reading is None:
                seq.reading = runner.prefill_chunks(ids)
            chunk = next(seq.reading)
            if chunk is None:
                return {}
            logits, seq.reading = chunk, None
        seq.computed = seq.given = len(seq.tokens)
        self.latest = runner
        self.stats.prompt_admitted(runner.reused_tokens, seq.held)
        self.prompt_tokens += len(seq.tokens)
        self.hit_tokens += runner.reused_tokens
        return {seq.handle: logits}

    def _decode(self, decoding: list[SlotSequence]) -> dict[int, np.ndarray]:
        if len(decoding) == 1:  # one sequence: its slot's own generate models
            seq = decoding[0]
            assert seq.slot is not None
            logits = {seq.slot: self.lanes[seq.slot].step(seq.tokens[-1])}
        else:
            logits = self.steps.step({s.slot: s.tokens[-1] for s in decoding if s.slot is not None})
        out = {}
        for seq in decoding:
            seq.computed = seq.given = len(seq.tokens)
            out[seq.handle] = logits[seq.slot]  # type: ignore[index]
        return out

    def restart(self) -> None:
        """After a step that did not end: every live sequence is read again from its tokens
        (its slot keeps what it wrote, so the prompt reuses it)."""
        for seq in self.live.values():
            if seq.slot is not None and (seq.computed or seq.reading is not None):
                seq.computed, seq.reading = 0, None
                seq.preemptions += 1
                self.stats.preemptions += 1

    # -- slots ---------------------------------------------------------------------------------
    def _free(self) -> list[int]:
        return [i for i in range(len(self.lanes)) if i not in self._holder]

    def _admit(self) -> None:
        """Waiting sequences into free slots: each to the one holding most of its prefix (the
        lowest of equals: the packed models read the lowest slots).  When a live sequence's
        slot holds a longer prefix of it, by a chunk at least, that slot's KV is copied into
        the free one first (a system prompt shared by concurrent chats is read once)."""
        while self.waiting and (free := self._free()):
            seq = self.waiting.popleft()
            slot = max(free, key=lambda i: (self._prefix(i, seq), -i))
            self._take(seq, slot)
            if not self.lanes[slot].prefix_reuse or seq.scores is not None:
                continue
            donor = max(self._holder, key=lambda i: self._prefix(i, seq))
            if self._prefix(donor, seq) >= self._prefix(slot, seq) + self.lanes[0].chunk:
                self.lanes[slot].copy_from(self.lanes[donor])

    def _prefix(self, slot: int, seq: SlotSequence) -> int:
        return self.lanes[slot].cached_prefix(seq.tokens)

    def _take(self, seq: SlotSequence, slot: int) -> None:
        seq.slot = slot
        self._holder[slot] = seq

    def _release(self, seq: SlotSequence) -> None:
        if seq.slot is not None and self._holder.get(seq.slot) is seq:
            del self._holder[seq.slot]
        seq.slot = None
