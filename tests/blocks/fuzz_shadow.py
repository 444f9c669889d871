"""Content side of the random driver: KV rows that say which tokens they hold, and checks.

Each token row a "runtime" writes holds four ``uint32`` words: its position, its token, a
rolling hash of the whole prefix up to it (a real K/V row depends on every earlier token), and
a check word mixing the two. The checks then compare bytes, not bookkeeping: every live row of a
sequence, and every row of every cached block, must hold exactly the words of the tokens its
table or its tree path says. The bytes live either in the manager's own numpy stores
(``OwnStore``) or in a runtime's arrays that the manager moves only through its ``copy_slots``
hook (``ExternalStore``), so both ways of moving bytes are checked.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from npuw_kv.kv.blocks import KVBlockManager, PoolKind

MASK = 0xFFFFFFFF
ROW_WORDS = 4  # position, token, prefix hash, check word
ROW_BYTES = 4 * ROW_WORDS


class RowWords:
    """The rows of one token sequence from position ``start`` on, extended as it grows.

    ``prefix_hash`` is the hash of the tokens before ``start`` (so a tree walk can continue a
    parent's rows without recomputing the whole path).
    """

    def __init__(self, start: int = 0, prefix_hash: int = 0) -> None:
        self.start = start
        self.rows: list[tuple[int, int, int, int]] = []
        self.hash = prefix_hash

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            p = self.start + len(self.rows)
            self.hash = ((self.hash * 1_000_003) ^ (t + 7)) & MASK
            self.rows.append((p, t & MASK, self.hash, (p * 2_654_435_761 ^ self.hash) & MASK))

    def row(self, pos: int) -> tuple[int, int, int, int]:
        return self.rows[pos - self.start]

    def array(self, lo: int, hi: int) -> np.ndarray:
        """Rows of positions ``[lo, hi)`` as ``[hi - lo, ROW_WORDS]`` uint32."""
        rows = self.rows[lo - self.start : hi - self.start]
        return np.asarray(rows, dtype=np.uint32).reshape(-1, ROW_WORDS)


class OwnStore:
    """Rows kept in the manager's own numpy stores (the first 16 bytes of each token row)."""

    name = "own"

    def bind(self, mgr: KVBlockManager) -> None:
        self.mgr = mgr
        for w, g in mgr.groups.items():
            if g.bytes_per_token < ROW_BYTES:
                raise ValueError(f"window {w}: {g.bytes_per_token} bytes a token < {ROW_BYTES}")

    def read(self, window: int, pool: PoolKind, slots: np.ndarray, offs: np.ndarray) -> np.ndarray:
        raw = self.mgr.storage(window, pool.value)[slots, offs, :ROW_BYTES]
        return np.ascontiguousarray(raw).view("<u4")

    def write(self, window: int, slots: np.ndarray, offs: np.ndarray, words: np.ndarray) -> None:
        raw = np.ascontiguousarray(words.astype("<u4")).view(np.uint8)
        self.mgr.storage(window)[slots, offs, :ROW_BYTES] = raw


class ExternalStore:
    """A runtime's own block arrays; the manager moves bytes only through :meth:`copy`."""

    name = "external"

    def __init__(self) -> None:
        self.arrays: dict[tuple[int, PoolKind], np.ndarray] = {}
        self.copies = 0

    def bind(self, mgr: KVBlockManager) -> None:
        for w, wm in mgr.windows.items():
            if wm.primary.store.nbytes or wm.host.store.nbytes:
                raise AssertionError(f"window {w}: a store was allocated beside copy_slots")
            for pool in (wm.primary, wm.host):
                shape = (pool.num_slots, wm.tpb, ROW_WORDS)
                self.arrays[w, pool.kind] = np.zeros(shape, dtype=np.uint32)

    def copy(self, window: int, sp: PoolKind, ss: int, dp: PoolKind, ds: int) -> None:
        src, dst = self.arrays[window, sp], self.arrays[window, dp]
        if not (0 <= ss < len(src) and 0 <= ds < len(dst)) or (sp, ss) == (dp, ds):
            raise AssertionError(f"window {window}: bad copy {sp.value}[{ss}] -> {dp.value}[{ds}]")
        dst[ds] = src[ss]
        self.copies += 1

    def grow(self, window: int, blocks: int) -> None:
        """The runtime's tensors grow, keeping their bytes (before the manager's pool does)."""
        old = self.arrays[window, PoolKind.PRIMARY]
        grown = np.zeros((blocks, *old.shape[1:]), dtype=old.dtype)
        grown[: len(old)] = old
        self.arrays[window, PoolKind.PRIMARY] = grown

    def read(self, window: int, pool: PoolKind, slots: np.ndarray, offs: np.ndarray) -> np.ndarray:
        return self.arrays[window, pool][slots, offs]

    def write(self, window: int, slots: np.ndarray, offs: np.ndarray, words: np.ndarray) -> None:
        self.arrays[window, PoolKind.PRIMARY][slots, offs] = words


Store = OwnStore | ExternalStore


def _first_live(table: np.ndarray) -> int:
    """Index of the first attached slot (tables are ``-1`` up to it, then all attached)."""
    attached = np.flatnonzero(table >= 0)
    return int(attached[0]) if len(attached) else len(table)


def check_live_rows(
    mgr: KVBlockManager, store: Store, sid: object, words: RowWords, upto: int, reads_from: int
) -> int:
    """Rows ``< upto`` in ``sid``'s live blocks hold its tokens; none of the rows a call starting
    at ``reads_from`` reads (its first token's window) is detached. Returns rows checked."""
    checked = 0
    for w in mgr.windows:
        tpb = mgr.groups[w].tokens_per_block
        table = np.asarray(mgr.block_table(sid, w), dtype=np.int64)
        lo = _first_live(table) * tpb
        if lo > max(0, reads_from - w + 1):
            raise AssertionError(
                f"window {w}: {sid!r} reads row {max(0, reads_from - w + 1)} at {reads_from} "
                f"tokens but rows below {lo} are detached"
            )
        if upto <= lo:
            continue
        pos = np.arange(lo, upto)
        got = store.read(w, PoolKind.PRIMARY, table[pos // tpb], pos % tpb)
        bad = ~(got == words.array(lo, upto)).all(axis=1)
        if bad.any():
            p = int(pos[bad][0])
            raise AssertionError(
                f"window {w}: row {p} of {sid!r} (block {p // tpb}, slot {table[p // tpb]}) "
                f"holds {got[bad][0].tolist()}, expected {words.row(p)}"
            )
        checked += len(pos)
    return checked


def write_rows(
    mgr: KVBlockManager, store: Store, sid: object, words: RowWords, lo: int, hi: int
) -> None:
    """Write rows ``[lo, hi)`` of ``sid`` into its primary slots, as a runtime's forward would."""
    if hi <= lo:
        return
    for w in mgr.windows:
        tpb = mgr.groups[w].tokens_per_block
        table = np.asarray(mgr.block_table(sid, w), dtype=np.int64)
        pos = np.arange(lo, hi)
        slots = table[pos // tpb]
        if (slots < 0).any():
            raise AssertionError(f"window {w}: {sid!r} writes row {lo} into a detached slot")
        store.write(w, slots, pos % tpb, words.array(lo, hi))


def check_tree_rows(mgr: KVBlockManager, store: Store) -> int:
    """Every cached block holds the rows of its tree path (wherever its bytes live now)."""
    checked = 0
    for w, wm in mgr.windows.items():
        if wm.tree is None:
            continue
        tpb = wm.tpb
        want: dict[PoolKind, tuple[list[int], list[np.ndarray]]] = {}
        stack = [(child, 0) for child in wm.tree.root.children.values()]
        while stack:
            node, parent_hash = stack.pop()
            words = RowWords((node.depth - 1) * tpb, parent_hash)
            words.extend(node.key)
            if node.block is not None:
                slots, rows = want.setdefault(node.block.pool, ([], []))
                slots.append(node.block.slot)
                rows.append(words.array(words.start, words.start + tpb))
            stack.extend((c, words.hash) for c in node.children.values())
        for pool, (slots, rows) in want.items():
            s = np.repeat(np.asarray(slots, dtype=np.int64), tpb)
            offs = np.tile(np.arange(tpb), len(slots))
            got = store.read(w, pool, s, offs).reshape(len(slots), tpb, ROW_WORDS)
            bad = ~(got == np.stack(rows)).all(axis=(1, 2))
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise AssertionError(
                    f"window {w}: cached block in {pool.value}[{slots[i]}] holds "
                    f"{got[i].tolist()}, expected {np.stack(rows)[i].tolist()}"
                )
            checked += len(slots)
    return checked
