"""A bench's child process (a worker, a snippet probe) ends with the bench: Ctrl-C (SIGINT),
SIGTERM or SIGKILL to the bench ends the child it is waiting for instead of leaving it running
(no model: the child is a sleeper)."""

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
# the snippet probe's parent (``bench --snippet-kernels``), its probe a sleeper too
SNIPPETS = """
import sys, subprocess
from npuw_kv.tools import children, snippets

real = subprocess.Popen

def announced(cmd, **kwargs):
    proc = real([sys.executable, "-c", "import time; time.sleep(120)"], **kwargs)
    print(proc.pid, flush=True)
    return proc

subprocess.Popen = announced
snippets.snippet_kernels()
"""


def _alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        state = next(line for line in status.read_text().splitlines() if line.startswith("State"))
    except (OSError, StopIteration):
        return False
    return "zombie" not in state


@pytest.mark.unit
@pytest.mark.parametrize("parent", [PARENT, SNIPPETS], ids=["bench-worker", "snippet-probe"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_a_signal_to_the_bench_ends_its_worker(parent, signum):
    """SIGINT and SIGTERM: the parent kills its child on the way out; SIGKILL (no handler
    runs): the kernel does (``tools.children``)."""
    parent = subprocess.Popen(
        [sys.executable, "-c", parent], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    line = parent.stdout.readline()
    while not line.strip().isdigit():  # the snippet table's header comes first
        assert line, parent.stderr.read() if parent.stderr else "no output"
        line = parent.stdout.readline()
    worker = int(line)
    assert _alive(worker)
    time.sleep(0.5)  # the parent is now waiting on the worker's output
    os.kill(parent.pid, signum)
    code = parent.wait(timeout=30)
    assert code != 0  # interrupted, not finished
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker), f"worker {worker} outlived the bench (signal {signum})"
