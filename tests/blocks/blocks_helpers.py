"""Shared builders for the block-manager tests (a plain module: ``conftest`` names clash)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from npuw_kv.kv.blocks import BlockManagerConfig, KVBlockManager, LayerSpec


def build(
    windows: Sequence[int | None],
    blocks: Sequence[int],
    *,
    max_seq_len: int = 32,
    tpb: int = 2,
    host: Sequence[int] | None = None,
    **kwargs: object,
) -> KVBlockManager:
    """Manager with one layer (1 kv head, head_dim 1, fp16: 4 bytes/token) per window.

    ``blocks``/``host`` give the exact primary/host block count per window, in ascending
    window order (None = full attention = max_seq_len, i.e. last).
    """
    keys = sorted({max_seq_len if w is None else w for w in windows})
    cfg = BlockManagerConfig(
        layers=[LayerSpec(w, 1, 1) for w in windows],
        max_seq_len=max_seq_len,
        primary_blocks=dict(zip(keys, blocks, strict=True)),
        host_blocks=dict(zip(keys, host, strict=True)) if host else None,
        tokens_per_block=tpb,
        **kwargs,  # type: ignore[arg-type]
    )
    return KVBlockManager(cfg)


class Runtime:
    """Drives a manager like an engine: every call writes its rows, every read row is checked."""

    def __init__(self, mgr: KVBlockManager) -> None:
        self.mgr = mgr
        self.tokens: dict[object, list[int]] = {}

    def add(self, sid: object, tokens: list[int], **kwargs: Any) -> int:
        hit = self.mgr.add_sequence(sid, tokens, **kwargs)
        self.tokens[sid] = list(tokens)
        check_read_rows(self.mgr, sid, tokens, hit)
        write_prefix_rows(self.mgr, sid, tokens, hit)
        return hit

    def add_tokens(self, sid: object, new: list[int]) -> None:
        n_old = len(self.tokens[sid])
        self.mgr.add_tokens(sid, new)
        self.tokens[sid] += new
        check_read_rows(self.mgr, sid, self.tokens[sid], n_old)
        write_prefix_rows(self.mgr, sid, self.tokens[sid], n_old)

    def add_chunked(self, sid: object, tokens: list[int], chunk: int) -> int:
        """The runtime protocol: look up, add a chunk after the hit, then chunk by chunk."""
        first = self.mgr.lookup(tokens).hit_tokens + chunk
        hit = self.add(sid, tokens[:first])
        for i in range(first, len(tokens), chunk):
            self.add_tokens(sid, tokens[i : i + chunk])
        return hit

    def remove(self, sid: object) -> None:
        self.mgr.remove_sequence(sid)
        del self.tokens[sid]
        self.mgr.check_invariants()
        check_tree_bytes(self.mgr)


def fill_rows(mgr: KVBlockManager, seq_id: object, start: int, stop: int, seed: int) -> None:
    """Write distinct bytes into rows [start, stop) of every window, like a runtime would."""
    rng = np.random.default_rng(seed)
    for w, g in mgr.groups.items():
        table = mgr.block_table(seq_id, w)
        store = mgr.storage(w)
        for p in range(start, stop):
            slot = table[p // g.tokens_per_block]
            store[slot, p % g.tokens_per_block] = rng.integers(0, 256, g.bytes_per_token)


def rows(mgr: KVBlockManager, seq_id: object, window: int, start: int, stop: int) -> np.ndarray:
    g = mgr.groups[window]
    table = mgr.block_table(seq_id, window)
    store = mgr.storage(window)
    return np.stack(
        [store[table[p // g.tokens_per_block], p % g.tokens_per_block] for p in range(start, stop)]
    )


MASK = 0xFFFFFFFF


def fingerprints(tokens: Sequence[int], start_hash: int = 0) -> list[int]:
    """Rolling hash of each prefix: what the KV row at that position depends on."""
    out, h = [], start_hash
    for t in tokens:
        h = ((h * 1_000_003) ^ (t + 7)) & MASK
        out.append(h)
    return out


def row_bytes(fp: int, width: int) -> np.ndarray:
    return np.resize(np.frombuffer(fp.to_bytes(4, "little"), dtype=np.uint8), width)


def _rows(fps: Sequence[int], width: int) -> np.ndarray:
    """``row_bytes`` of many fingerprints at once: ``[len(fps), width]`` uint8."""
    raw = np.asarray(fps, dtype="<u4").view(np.uint8).reshape(-1, 4)
    return np.tile(raw, (1, -(-width // 4)))[:, :width]


def _positions(mgr: KVBlockManager, seq_id: object, w: int, lo: int, hi: int) -> tuple:
    tpb = mgr.groups[w].tokens_per_block
    table = np.asarray(mgr.block_table(seq_id, w), dtype=np.int64)
    pos = np.arange(lo, hi)
    return table[pos // tpb], pos % tpb, pos


def write_prefix_rows(
    mgr: KVBlockManager, seq_id: object, tokens: Sequence[int], start: int
) -> None:
    """Like a runtime: write rows [start, len(tokens)) with their prefix fingerprints."""
    fps = fingerprints(tokens)
    for w, g in mgr.groups.items():
        slots, offs, pos = _positions(mgr, seq_id, w, start, len(tokens))
        assert (slots >= 0).all(), f"window {w}: a row in {start}..{len(tokens)} is detached"
        mgr.storage(w)[slots, offs] = _rows(fps[start:], g.bytes_per_token)


def check_read_rows(mgr: KVBlockManager, seq_id: object, tokens: Sequence[int], n_old: int) -> None:
    """The rows a call starting at ``n_old`` reads (its first token's window) hold its tokens.

    This is what a prefix hit hands out: a wrong byte here is a silently wrong answer.
    """
    fps = fingerprints(tokens)
    for w, g in mgr.groups.items():
        lo = max(0, n_old - w + 1)
        slots, offs, pos = _positions(mgr, seq_id, w, lo, n_old)
        if (slots < 0).any():
            raise AssertionError(f"window {w}: row {pos[slots < 0][0]} read at {n_old} detached")
        bad = ~(mgr.storage(w)[slots, offs] == _rows(fps[lo:n_old], g.bytes_per_token)).all(1)
        if bad.any():
            raise AssertionError(
                f"window {w}: row {pos[bad][0]} read at {n_old} tokens holds another token's bytes"
            )


def check_tree_bytes(mgr: KVBlockManager) -> int:
    """Every cached block holds the fingerprints of its tree path; returns blocks checked."""
    checked = 0
    for w, wm in mgr.windows.items():
        if wm.tree is None:
            continue
        found: dict[object, tuple[list[int], list[int], list[int]]] = {}
        stack = [(child, 0) for child in wm.tree.root.children.values()]
        while stack:
            node, h = stack.pop()
            fps = fingerprints(node.key, h)
            if node.block is not None:
                slots, all_fps, depths = found.setdefault(node.block.pool, ([], [], []))
                slots.append(node.block.slot)
                all_fps.extend(fps)
                depths.append(node.depth)
            stack.extend((c, fps[-1]) for c in node.children.values())
        for kind, (slots, all_fps, depths) in found.items():
            got = wm.pools[kind].store[slots]  # type: ignore[index]
            want = _rows(all_fps, wm.group.bytes_per_token).reshape(got.shape)
            bad = ~(got == want).all(axis=(1, 2))
            if bad.any():
                depth = np.asarray(depths)[bad][0]
                raise AssertionError(f"window {w}: cached block at depth {depth} has wrong bytes")
            checked += len(slots)
    return checked
