"""Host copies for KV rows that a device will not read or write in place.

Two cases the shared cache needs:

* a device that refuses strided tensors gets contiguous *staging* tensors; the rows are copied
  between staging and the shared buffer around each inference;
* source and destination overlap with different layouts (e.g. V transposed on one side): a
  direct A->A copy would read rows it has already overwritten, so such copies go through a
  temporary buffer.
"""

from __future__ import annotations

import numpy as np


class CopyCounter:
    """Bytes moved on the host, so ``kv_stats()`` can report them per request."""

    def __init__(self) -> None:
        self.bytes = 0
        self.copies = 0

    def reset(self) -> None:
        self.bytes = 0
        self.copies = 0


def safe_copy(dst: np.ndarray, src: np.ndarray, counter: CopyCounter | None = None) -> None:
    """Copy ``src`` into ``dst`` (same shape), correct even when the two alias.

    ``np.copyto`` on overlapping views with different strides is not guaranteed to read each
    element before it is overwritten; a temporary breaks the aliasing.
    """
    if dst.shape != src.shape:
        raise ValueError(f"copy shape mismatch: dst {dst.shape} vs src {src.shape}")
    if np.shares_memory(dst, src):
        src = src.copy()
    np.copyto(dst, src)
    if counter is not None:
        counter.bytes += dst.nbytes
        counter.copies += 1
