"""A bench's worker process ends with the bench: Ctrl-C (SIGINT) or SIGTERM to the bench kills
the worker it is waiting for instead of leaving it running (no model: the worker is a sleeper)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# a bench parent whose one worker sleeps; it prints the worker's pid once the worker runs
PARENT = """
import sys, subprocess
from npuw_kv.tools import bench_worker

real = subprocess.Popen

def announced(*args, **kwargs):
    proc = real(*args, **kwargs)
    print(proc.pid, flush=True)
    return proc

subprocess.Popen = announced
bench_worker.worker_result([sys.executable, "-c", "import time; time.sleep(120)"], "sleeper")
"""


def _alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        state = next(line for line in status.read_text().splitlines() if line.startswith("State"))
    except (OSError, StopIteration):
        return False
    return "zombie" not in state


@pytest.mark.unit
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_bench_ends_its_worker(signum):
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    worker = int(parent.stdout.readline())
    assert _alive(worker)
    time.sleep(0.5)  # the parent is now waiting on the worker's output
    os.kill(parent.pid, signum)
    code = parent.wait(timeout=30)
    assert code != 0  # interrupted, not finished
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker), f"worker {worker} outlived the bench (signal {signum})"
