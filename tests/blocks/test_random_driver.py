"""The random driver (``fuzz_driver``) at a fixed seed, and proof that it catches planted bugs.

``python tests/blocks/fuzz.py --ops 100000 --seed N`` runs the same driver for longer.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fuzz_driver import FuzzFailure, run

from npuw_kv.kv.blocks import KVBlock, PoolKind
from npuw_kv.kv.blocks import reclaim as reclaim_module
from npuw_kv.kv.blocks import window_manager as wm_module
from npuw_kv.kv.blocks.reclaim import Reclaimer

pytestmark = pytest.mark.unit  # builds no model (the quick tier)

OPS = 25_000


def test_the_long_run_command_runs_the_driver() -> None:
    fuzz = Path(__file__).with_name("fuzz.py")
    cmd = [sys.executable, str(fuzz), "--ops", "1000", "--seed", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"checked: [1-9]\d* live rows", proc.stdout), proc.stdout


def test_random_driver_fixed_seed() -> None:
    start = time.perf_counter()
    stats = run(OPS, seed=2024)
    seconds = time.perf_counter() - start
    print(f"random driver: {stats.ops} operations, {stats.episodes} episodes, {seconds:.1f} s")
    print(stats)
    assert stats.ops >= OPS
    assert stats.hits and stats.forks and stats.grows and stats.preemptions and stats.rows_checked
    assert stats.cached_checked
    for path in (
        "reused_blocks", "copied_blocks", "offloads", "onboards", "removed_blocks",
        "invalidated_sequences", "detached_blocks", "external_copies",
    ):  # fmt: skip
        assert stats.manager[path] > 0, f"no {path} in {stats.ops} operations"
    for error in ("OutOfBlocksError", "ChunkTooLargeError", "UnknownSequenceError"):
        assert stats.refused[error] > 0, f"no {error} in {stats.ops} operations"


def test_driver_catches_a_host_reset_without_a_generation_bump(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reset = Reclaimer._reset

    def stale_host_reset(self: Reclaimer, block: KVBlock, taker: int | None = None) -> None:
        gen = block.gen
        reset(self, block, taker)
        if block.pool is PoolKind.HOST:
            block.gen = gen

    monkeypatch.setattr(Reclaimer, "_reset", stale_host_reset)
    with pytest.raises(FuzzFailure, match="reset since|empty"):
        run(OPS, seed=0)


def test_driver_catches_an_swa_hit_that_is_not_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wm_module, "copy_bytes", lambda src, dst, copy: None)
    with pytest.raises(FuzzFailure, match="holds"):
        run(OPS, seed=0)


def test_driver_catches_an_offload_that_moves_no_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    def swap_only(src: KVBlock, dst: KVBlock, copy: object) -> None:
        src.pool, dst.pool = dst.pool, src.pool
        src.slot, dst.slot = dst.slot, src.slot

    monkeypatch.setattr(reclaim_module, "move_bytes", swap_only)
    with pytest.raises(FuzzFailure, match="holds"):
        run(OPS, seed=0)
