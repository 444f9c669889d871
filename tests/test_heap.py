"""The glibc heap: free pages go back to the OS, large blocks get their own mappings."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

from npuw_kv.runtime.heap import MMAP_THRESHOLD, _malloc_trim, release_free_heap

BLOCK, COUNT = 4096, 16384  # 64 MB in blocks well below glibc's mmap threshold


def _rss_anon_mb() -> float:
    with open("/proc/self/status") as status:
        line = next(x for x in status if x.startswith("RssAnon:"))
    return int(line.split()[1]) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc heap behaviour")
def test_freed_heap_pages_are_released() -> None:
    assert _malloc_trim() is not None, "glibc malloc_trim not found on this Linux machine"
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(BLOCK) for _ in range(COUNT)]
    for block in blocks:
        ctypes.memset(block, 1, BLOCK)  # touch: the pages are now resident
    pin = libc.malloc(BLOCK)  # a live block above the others keeps free() from trimming the top
    ctypes.memset(pin, 1, BLOCK)
    for block in blocks:
        libc.free(block)
    held = _rss_anon_mb()
    assert release_free_heap() is True
    released = held - _rss_anon_mb()
    libc.free(pin)
    assert released > 32, f"only {released:.1f} MB of 64 MB freed heap went back to the OS"


# Run in a fresh process: prints how many new mmapped chunks one 512 KiB malloc made, after an
# 8 MiB block was freed (which raises glibc's adaptive mmap threshold to 8 MiB).
_MMAP_PROBE = """
import ctypes, sys
from npuw_kv.runtime.heap import fix_mmap_threshold
names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in names]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
fixed = fix_mmap_threshold() if sys.argv[1] == "fix" else None
libc.free(libc.malloc(8 << 20))
before = libc.mallinfo2().hblks
block = libc.malloc(512 << 10)
print(fixed, libc.mallinfo2().hblks - before)
"""


def _probe(mode: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    run = [sys.executable, "-c", _MMAP_PROBE, mode]
    return subprocess.run(
        run, env={**environ, **env}, capture_output=True, text=True, check=True
    ).stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc heap behaviour")
def test_fixed_mmap_threshold_keeps_mid_size_blocks_out_of_the_heap() -> None:
    assert MMAP_THRESHOLD < 512 << 10
    assert _probe("adaptive") == "None 0"  # glibc alone: served from the heap, may fragment it
    assert _probe("fix") == "True 1"  # its own mapping, unmapped again on free
    # a threshold the user set through glibc's own variable wins
    assert _probe("fix", MALLOC_MMAP_THRESHOLD_="1048576") == "False 0"
