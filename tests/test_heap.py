"""release_free_heap: free pages held by glibc go back to the OS."""

from __future__ import annotations

import ctypes
import sys

import pytest

from npuw_kv.runtime.heap import _malloc_trim, release_free_heap

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
