"""Child processes that end with the process that started them.

A bench worker, a snippet probe or a server under test is killed on the way out when its
parent is interrupted (``bench_worker``'s handlers), but a parent killed outright (SIGKILL, the
OOM killer) runs no handler.  On Linux the kernel can do it: ``PR_SET_PDEATHSIG`` makes the
child receive SIGKILL when the thread that started it ends, so no child outlives its parent.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from typing import Any

_PR_SET_PDEATHSIG = 1
# looked up here, in the parent: the child between fork and exec should only make the call
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def _tie_to(parent: int) -> None:
    assert _prctl is not None
    if _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before the tie was made
        os._exit(1)


def start(cmd: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(cmd, **kwargs)``, the child killed when this thread or process ends
    (Linux; elsewhere the interrupt handlers alone see to it)."""
    if _prctl is not None:
        parent = os.getpid()
        kwargs["preexec_fn"] = lambda: _tie_to(parent)
    return subprocess.Popen(cmd, **kwargs)


def run_output(cmd: list[str]) -> str:
    """A tied child's stdout (``subprocess.run(..., check=True)``'s, with its stderr in the
    error when it fails); on an interrupt the child is killed before the interrupt goes on."""
    proc = start(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd, out, err)
    return str(out)
