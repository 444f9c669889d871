"""Per-sequence block table of one window group, and the arithmetic of linear writing.

Blocks are written linearly, never as a ring: block ``i`` of the table holds tokens
``[i*tpb, (i+1)*tpb)``. In a sliding-window group, front blocks are *detached* once
``num_tokens - detached*tpb >= window + tpb``; detached slots stay in the table (so the sequence
can still store them for reuse when it ends) but the sequence never reads them again.

One call may add many tokens (a prefill chunk). The attention of the chunk's *first* token
still reads the ``window - 1`` tokens before it, so a call detaches only what that first token can
no longer see: the rule is evaluated at ``n_old + 1`` tokens, before the call's new blocks are
allocated (so freed blocks are available to it). The rest of the detaching happens on the next
call. For one token per call (decoding) this is exactly the rule above, token by token. A prompt
added in one call therefore holds all its blocks until the next call: add long prompts in chunks
(``add_sequence(id, prompt[:hit + C])`` then ``add_tokens`` per chunk, with
``hit = lookup(prompt).hit_tokens``) and an SWA window holds about ``(window + C) / tpb + 1``
blocks at a time. ``max_tokens_per_call`` bounds ``C``, so the budget check at construction
(``min_live_blocks``) can promise that one ``max_seq_len`` sequence always fits.

Each table slot records the block's *generation* (``KVBlock.gen``, bumped every time the block
is reset: handed out by the free-block path, or emptied in the host pool for an offload). A
detached slot whose generation no longer matches was reset since (and possibly overwritten by a
later owner, even this very sequence at another position), so its bytes are not the tokens of
that slot and it must never be stored for reuse.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .block import KVBlock, TreeNode
from .eviction import PrioritySpec


def blocks_for(n_tokens: int, tpb: int) -> int:
    """Table slots needed for ``n_tokens`` tokens."""
    return -(-n_tokens // tpb)


def detached_after(n_tokens: int, window: int, tpb: int, detached: int) -> int:
    """Detached-block count once the sequence holds ``n_tokens`` tokens."""
    return max(detached, (n_tokens - window) // tpb)


def live_after_call(n_from: int, n_to: int, window: int, tpb: int, detached: int) -> int:
    """Live blocks after one call grows a sequence from ``n_from`` to ``n_to`` tokens."""
    if n_to <= n_from:
        return blocks_for(n_from, tpb) - detached
    return blocks_for(n_to, tpb) - detached_after(n_from + 1, window, tpb, detached)


def min_live_blocks(max_seq_len: int, window: int, tpb: int, chunk: int = 1) -> int:
    """Fewest primary blocks that let one sequence reach ``max_seq_len`` on an empty manager.

    Calls add at most ``chunk`` tokens each but may start at any length (a prefix hit, or
    chunks of different sizes), so the peak is taken over every start ``n`` of a call:
    ``blocks_for(min(n + chunk, max_seq_len)) - detached_after(n + 1)``. Before a call the
    sequence has detached exactly what token ``n`` could not see (``detached_after`` is
    monotone), and a hit of ``k`` blocks starts with the same detached count, so this is exact.

    Two starts suffice (no per-token array: the check runs for any ``max_seq_len``). With
    ``c = max(1, chunk)`` and ``L = max_seq_len``: up to ``window + tpb - 2`` nothing is
    detached yet and the peak grows with ``n``; from there to ``L - c`` both terms grow by one
    every ``tpb`` tokens, so the peak only repeats; past ``L - c`` the call is capped at ``L``
    and the peak only falls. So the peak is at ``min(window + tpb - 2, L - c)`` or ``L - c + 1``.
    """
    c = max(1, chunk)
    last_full = max_seq_len - c  # last start whose call is not capped by max_seq_len
    starts = (min(window + tpb - 2, last_full), max(0, last_full + 1))
    return max(
        blocks_for(min(n + c, max_seq_len), tpb) - detached_after(n + 1, window, tpb, 0)
        for n in starts
        if 0 <= n < max_seq_len
    )


def required_trailing_blocks(window: int, tpb: int) -> int:
    """Blocks before a hit point an attention window of ``window`` tokens reads.

    The new token attends to itself and the ``window - 1`` tokens before it.
    """
    return -(-(window - 1) // tpb)


@dataclass(eq=False)
class SeqBlocks:
    """One live sequence's blocks in one window group."""

    serial: int
    priorities: PrioritySpec
    table: list[KVBlock | None] = field(default_factory=list)
    #: ``gens[i]``: generation of ``table[i]`` when this sequence took it (see module docstring)
    gens: list[int] = field(default_factory=list)
    #: index of the first live block; slots before it are detached (or never claimed)
    first_live: int = 0
    #: False once another sequence's allocation overwrote one of its blocks (SWA: never stored
    #: then)
    storable: bool = True
    #: blocks before this index may be stored; set when the runtime says the sequence's next
    #: blocks are not worth caching (``add_tokens(store=False)``); None: no limit
    store_upto: int | None = None
    #: full-attention groups store while filling: depth stored so far and the node there
    stored_depth: int = 0
    stored_node: TreeNode | None = None

    def put(self, index: int, block: KVBlock) -> None:
        """Place ``block`` at table slot ``index`` (appending if it is the next slot)."""
        if index == len(self.table):
            self.table.append(block)
            self.gens.append(block.gen)
        else:
            self.table[index] = block
            self.gens[index] = block.gen

    def storable_upto(self, n_blocks: int) -> int:
        """How many of the first ``n_blocks`` blocks may be stored (0 when invalidated)."""
        if not self.storable:
            return 0
        return n_blocks if self.store_upto is None else min(n_blocks, self.store_upto)

    def holds_bytes(self, index: int) -> bool:
        """True while slot ``index`` still has the bytes this sequence wrote or claimed."""
        block = self.table[index]
        return block is not None and block.gen == self.gens[index]

    def live(self) -> list[KVBlock]:
        out: list[KVBlock] = []
        for b in self.table[self.first_live :]:
            if b is None:
                raise RuntimeError(f"sequence serial {self.serial} has a hole in its live blocks")
            out.append(b)
        return out
