"""Hand the C heap's free pages back to the OS once a pipeline is built.

Compiling an OpenVINO model builds and drops many temporary graphs.  glibc keeps that freed
memory in its arenas, so it stays in the process's resident set for the pipeline's lifetime:
with SmolLM2 on CPU, 14 MB after loading and 12 MB of the run's peak RSS (README, "Speed and
memory").  ``malloc_trim(0)`` releases the free pages; nothing in use moves.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None on another platform or C library (e.g. musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim  # symbols of the running process, libc included
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_free_heap() -> bool:
    """Return free heap pages to the OS; True if any were released, False if none or no glibc."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
