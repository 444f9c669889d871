"""How much host memory an allocation may take, checked before it is made.

A KV cache or host store sized from a setting can ask for more than the machine holds.  numpy
and OpenVINO then either fail late (``MemoryError``, ``std::bad_alloc``) or succeed lazily and
let the kernel kill the process when the pages are touched.  So every large buffer is checked
against the memory the kernel says is available first, and refused with ``MemoryError``, which
the pipeline turns into an error naming the settings to lower.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

PAGE = mmap.PAGESIZE

# what is left for the model's weights, activations and everything else in the process
HEADROOM = 0.9


def available_bytes() -> int | None:
    """Memory the kernel can give without swapping (Linux ``MemAvailable``), or None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def ensure_fits(nbytes: int, what: str) -> None:
    """Raise ``MemoryError`` when ``nbytes`` for ``what`` exceed the available memory."""
    available = available_bytes()
    if available is not None and nbytes > HEADROOM * available:
        raise MemoryError(
            f"{what} needs {nbytes / 2**20:,.0f} MiB, more than the "
            f"{available / 2**20:,.0f} MiB this machine has available"
        )


def aligned_zeros(count: int, dtype: np.dtype) -> np.ndarray:
    """``count`` zeroed elements of ``dtype`` whose first byte is on a page boundary: what a
    device can import from host memory without a copy (an NPU: runtime/npu_rules.py)."""
    dtype = np.dtype(dtype)
    raw = np.zeros(count * dtype.itemsize + PAGE, np.uint8)
    skip = -int(raw.ctypes.data) % PAGE
    return raw[skip : skip + count * dtype.itemsize].view(dtype)
