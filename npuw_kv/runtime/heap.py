"""Keep memory the pipeline no longer uses out of the resident set: glibc's heap, oneDNN's cache.

Compiling an OpenVINO model builds and drops many temporary graphs.  glibc keeps that freed
memory in its arenas, so it stays in the process's resident set for the pipeline's lifetime.
``malloc_trim(0)`` releases the free pages; nothing in use moves.

While it runs, the CPU plugin's dynamic-shape model re-sizes buffers of a few hundred KB each time a
request switches between the prefill and the generate shapes. glibc serves those from its arenas
once its adaptive mmap threshold has risen (it does after the first large free), and the holes they
leave add up request by request.  A fixed threshold of 256 KiB gives such blocks their own mappings,
which go back to the OS when freed; the resident set then stays flat.

oneDNN (inside the CPU plugin) keeps the primitives it builds in a process-wide cache of 1024,
whether the plugin still uses them or not.  A PagedAttention model builds new ones for each new
prompt length, so with the plugin's own cache kept small (``runtime/device.py``) oneDNN's held what
it dropped, rising with every new length.  No cache at all kept that flat, but NPUW on the CPU then
JIT-compiled a reorder kernel for every strided KV view (a past ``[0, P)`` of the shared buffer, a
present slot) on every call, which slowed decode and prefill.  A cache of
``PRIMITIVE_CACHE_CAPACITY`` holds what both paths reuse: the paged path stays flat and the NPU path
builds nothing per call (the figures: docs/measurements.md, "oneDNN's primitive cache" and "Figures
behind the code's choices"). oneDNN reads its size from the environment once, when it builds its
first primitive, which loading a tokenizer already does: hence it is set when this module is
imported, unless the user set it.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from typing import Any

M_MMAP_THRESHOLD = -3  # mallopt parameter number in glibc's <malloc.h>
MMAP_THRESHOLD = 256 * 1024
PRIMITIVE_CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY")
PRIMITIVE_CACHE_CAPACITY = 32  # primitives: 8 already rebuilt some on the NPU path (module doc)


@functools.cache
def _glibc_function(name: str, argtypes: tuple[Any, ...], restype: Any) -> Any:
    """A typed glibc function of the running process, or None on another platform or C library.

    ``malloc_trim`` marks glibc: musl, for one, has no such function.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the process's symbols, libc included
        libc.malloc_trim  # noqa: B018 -- raises AttributeError without glibc
        function = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = list(argtypes), restype
    return function


def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None without glibc (e.g. musl)."""
    return _glibc_function("malloc_trim", (ctypes.c_size_t,), ctypes.c_int)


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Serve allocations of ``threshold`` bytes and up from their own mappings, process-wide.

    Leaves glibc alone when the user tuned it through ``MALLOC_MMAP_THRESHOLD_``.  Returns True
    if the threshold was set.
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    mallopt = _glibc_function("mallopt", (ctypes.c_int, ctypes.c_int), ctypes.c_int)
    return mallopt is not None and bool(mallopt(M_MMAP_THRESHOLD, threshold))


def release_free_heap() -> bool:
    """Return free heap pages to the OS; True if any were released, False if none or no glibc."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


def limit_primitive_cache(capacity: int = PRIMITIVE_CACHE_CAPACITY) -> bool:
    """Size oneDNN's process-wide primitive cache, unless the user already did.

    Takes effect only before oneDNN builds its first primitive in the process.  Returns True
    if the size was set.
    """
    if any(name in os.environ for name in PRIMITIVE_CACHE_ENV):
        return False
    os.environ[PRIMITIVE_CACHE_ENV[0]] = str(capacity)
    return True


limit_primitive_cache()  # before any CPU model runs: see the module docstring
