"""Host copies for KV rows that a device will not read or write in place.

Three cases the shared cache needs:

* a device that refuses strided tensors gets contiguous *staging* tensors; the rows are copied
  between staging and the shared buffer around each inference (:func:`safe_copy`);
* the same slots in two layouts, ``[1, H, S, D]`` and V transposed ``[1, H, D, S]``, when the
  prefill and the generate models store V differently (:func:`relayout`, NPUW's
  ``copy_tensor_by_dim``);
* source and destination overlap with different layouts (the relayout above is done in place,
  as NPUW's models alias one base pointer): a direct A->A copy would read rows it has already
  overwritten, so such copies go through a temporary buffer.
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


def _tokens_first(array: np.ndarray, head: int, seq_axis: int) -> np.ndarray:
    """One head of a ``[1, H, S, D]`` / ``[1, H, D, S]`` tensor as an ``[S, D]`` view."""
    plane = array[0, head]
    return plane if seq_axis == 2 else plane.T


def copy_by_dim(dst: np.ndarray, src: np.ndarray, dst_axis: int, src_axis: int) -> None:
    """Copy KV slots from ``src`` (sequence along ``src_axis``) into ``dst`` (along
    ``dst_axis``): NPUW's ``copy_tensor_by_dim``.  Same layout: one plane per head; different
    layouts: a 4-D permute, one ``head_dim`` column at a time (``S`` strided elements each).

    It does **not** handle overlap: with ``dst`` and ``src`` in one memory, a column written
    early lands on source elements read later.  :func:`relayout` is the safe entry point.
    """
    heads = src.shape[1]
    for head in range(heads):
        source = _tokens_first(src, head, src_axis)
        target = _tokens_first(dst, head, dst_axis)
        if source.shape != target.shape:
            raise ValueError(f"relayout shape mismatch: {source.shape} -> {target.shape}")
        if src_axis == dst_axis:
            target[...] = source
            continue
        for column in range(source.shape[1]):
            target[:, column] = source[:, column]


def relayout(
    dst: np.ndarray,
    src: np.ndarray,
    dst_axis: int,
    src_axis: int,
    counter: CopyCounter | None = None,
) -> None:
    """:func:`copy_by_dim`, correct when ``dst`` and ``src`` overlap: the source is first
    copied to a temporary (as NPUW's ``copy_kvcache`` does when its tensors alias)."""
    if np.may_share_memory(dst, src):
        src = src.copy()  # the temporary that makes an in-place relayout correct
    copy_by_dim(dst, src, dst_axis, src_axis)
    if counter is not None:
        counter.bytes += dst.nbytes
        counter.copies += 1
