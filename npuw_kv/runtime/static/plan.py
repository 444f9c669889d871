"""Where each token's KV lives, and the masks / position ids that say so.

Slot layout.  A prompt of N tokens is padded at the *front* of its first chunk to P = ceil(N/C)*C
tokens, so every chunk is full and the prompt's last token is the last row of the last chunk
(the prefill LM head reads only that row).  Token i sits in KV slot ``pad + i``; the pad slots
are masked out forever.  Chunk k writes slots ``[kC, kC+C)``, generate step t writes slot
``P + t``.  Front padding (not NPUW's last-chunk padding) keeps pad rows from ever landing on a
slot that holds real KV, so outputs can be written straight into the shared buffer.

A *continuation* (the new prompt starts with tokens whose KV is still in the cache, as in a chat)
keeps their slots: token i stays at ``first_slot + i`` and the chunks are laid out backwards
from the prompt's end, so again the last row is the last token.  The first chunk may start
inside the cached part; it recomputes those rows into their own slots (the same values).

:class:`Slots` is the one owner of this arithmetic while a sequence runs: where the live
tokens start, where the next token's KV goes, its position, and what the mask of each call
covers; the runner and the bindings ask it rather than keep counters of their own.

Attention masks follow the stateless graph: ``[past slots..., current tokens...]``.  The past
part covers slots ``[0, past_len)`` of the buffer; only real, already-written slots are 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import UsageError


@dataclass(frozen=True)
class PromptPlan:
    num_tokens: int
    chunk: int
    first_slot: int | None = None  # continuation: the slot of token 0 (None: a fresh prompt)
    cached: int = 0  # continuation: leading tokens whose KV already sits in its slots

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise UsageError("prompt is empty: at least one token is needed")
        if self.first_slot is None and self.cached:
            raise ValueError("cached tokens need the first_slot they were written from")
        if not 0 <= self.cached < self.num_tokens:
            raise ValueError(
                f"{self.cached} cached tokens of a {self.num_tokens}-token prompt: "
                "at least one must be run"
            )
        if self.start < 0:
            raise ValueError(f"the first chunk would start at slot {self.start}")

    @property
    def pad(self) -> int:
        """The slot of token 0; the slots before it are padding, masked for good."""
        if self.first_slot is not None:
            return self.first_slot
        return -(-self.num_tokens // self.chunk) * self.chunk - self.num_tokens

    @property
    def padded_len(self) -> int:
        """The slot after the prompt's last token: where generation writes first."""
        return self.pad + self.num_tokens

    @property
    def num_chunks(self) -> int:
        return -(-(self.num_tokens - self.cached) // self.chunk)

    @property
    def start(self) -> int:
        return self.padded_len - self.num_chunks * self.chunk

    def chunk_slots(self, k: int) -> tuple[int, int]:
        first = self.start + k * self.chunk
        return first, first + self.chunk


@dataclass
class Slots:
    """The live sequence's slots in a buffer of ``capacity`` slots (MAX_PROMPT_LEN +
    MIN_RESPONSE_LEN - 1: the last token's KV is never read, its step writes scratch)."""

    capacity: int
    first: int = 0  # slot of token 0 (after front padding)
    next: int = 0  # where the next token's KV goes
    position: int = 0  # the next token's position

    def start(self, plan: PromptPlan) -> None:
        """The prompt of ``plan`` has run: its tokens fill ``[pad, padded_len)``."""
        self.first, self.next, self.position = plan.pad, plan.padded_len, plan.num_tokens

    @property
    def tokens_in_cache(self) -> int:
        return min(self.next, self.capacity) - self.first

    @property
    def remaining(self) -> int:
        """Tokens that can still be fed (the last one's KV goes to scratch)."""
        return self.capacity + 1 - self.next

    @property
    def keeps_next(self) -> bool:
        """Whether the next token's KV lands in the buffer (not the last step's scratch)."""
        return self.next < self.capacity

    def step_inputs(self, token: int, past_len: int) -> StepInputs:
        """Inputs of the generate step that feeds ``token`` (``advance`` once it ran)."""
        return generate_inputs(token, self.next, self.position, self.first, past_len)

    def advance(self) -> None:
        self.next += 1
        self.position += 1


def chunk_past_len(plan: PromptPlan, k: int, grows: bool, fixed: int) -> int:
    """Past slots chunk ``k``'s request reads: the slots before the chunk for a request whose
    past grows with the prompt, else its fixed past (a static model's whole past)."""
    return plan.chunk_slots(k)[0] if grows else fixed


@dataclass
class StepInputs:
    input_ids: np.ndarray  # [1, T] int64
    position_ids: np.ndarray  # [1, T] int64
    attention_mask: np.ndarray  # [1, past_len + T] int64
    write_slots: tuple[int, int]  # where the present rows go
    first_slot: int = 0  # the slot of token 0: those before it are padding


def prefill_inputs(ids: np.ndarray, plan: PromptPlan, k: int, past_len: int) -> StepInputs:
    """Inputs of chunk ``k``; ``past_len`` is the past the request reads (its mask is
    ``past_len + C`` long): the slots before the chunk, or a static model's whole past."""
    c = plan.chunk
    start, stop = plan.chunk_slots(k)
    if start > past_len:
        raise ValueError(f"chunk {k} starts at slot {start}, beyond past length {past_len}")
    slots = np.arange(start, stop)
    positions = slots - plan.pad
    real = positions >= 0
    chunk_ids = np.zeros(c, np.int64)
    chunk_ids[real] = ids[positions[real]]
    mask = np.zeros(past_len + c, np.int64)
    mask[plan.pad : start] = 1
    mask[past_len:] = real
    return StepInputs(
        chunk_ids[None, :],
        np.maximum(positions, 0).astype(np.int64)[None, :],
        mask[None, :],
        (start, stop),
        plan.pad,
    )


def generate_inputs(
    token: int, slot: int, position: int, first_slot: int, past_len: int
) -> StepInputs:
    """Inputs of one generate step writing ``slot``; slots ``[first_slot, slot)`` are live."""
    if slot > past_len:
        raise ValueError(f"slot {slot} beyond generate past length {past_len}")
    mask = np.zeros(past_len + 1, np.int64)
    mask[first_slot:slot] = 1
    mask[-1] = 1
    return StepInputs(
        np.array([[token]], np.int64),
        np.array([[position]], np.int64),
        mask[None, :],
        (slot, slot + 1),
        first_slot,
    )
