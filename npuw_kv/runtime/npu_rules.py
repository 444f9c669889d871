"""What an Intel NPU does with the tensors a request is given, by the NPU plugin's own source.

No NPU can be reached where npuw-kv is tested, so its rules are written down here once, from
OpenVINO 2026.4's ``src/plugins/intel_npu/`` (docs/npuw-notes.md, "A real NPU's I/O rules",
cites the lines), and used three ways: the static runner stages what an NPU refuses, the
runner's ``npu_copied_bytes_estimate`` counts what an NPU copies, and :mod:`.npu_double`
enforces them on NPUW's CPU stand-in so that the tests meet them before a user's laptop does.

* **Strided outputs are refused** (``ZeroInferRequest::set_tensor`` -> ``check_tensor``) unless
  the port was compiled with strides (``NPU_ENABLE_STRIDES_FOR``).  NPUW stores the user's
  output tensor and hands it to its sub-request just before that one runs, so the refusal
  comes at the first ``infer()``, not at ``set_output_tensor``.
* **Global inputs are copied** by NPUW into its own tensors on every call
  (``bind_global_params``), unless the tensor lies in the NPU's memory *and* is contiguous.
* **Host memory is imported** without a copy only where its address and size are both
  page-aligned (``zero_mem.cpp``); an output elsewhere is staged by the plugin.
* **Zero-size inputs** are stripped by NPUW's own LLM pipeline before it compiles for the NPU
  (``RemoveEmptyKVTensors``); npuw-kv strips its own (:func:`npuw_kv.model.transforms.
  drop_empty_inputs`) and the double refuses any that remain.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import openvino as ov

from ..kv.memory import PAGE, aligned_zeros

# the plugin's words for a non-contiguous output (ZeroInferRequest::check_tensor)
STRIDED_REFUSED = "Failed to set tensor. The tensor has a non-contiguous memory layout"


def strided_output_refused(exc: BaseException) -> bool:
    """Whether ``exc`` is the plugin's refusal of a strided tensor."""
    return STRIDED_REFUSED in str(exc) or "non-contiguous memory layout" in str(exc)


def address(tensor: ov.Tensor) -> int:
    """Where ``tensor``'s first element lies in host memory."""
    return int(tensor.data.ctypes.data)


def page_aligned(tensor: ov.Tensor) -> bool:
    """Whether the plugin can import ``tensor`` as it is: address and size on page bounds."""
    return address(tensor) % PAGE == 0 and tensor.byte_size % PAGE == 0


class DeviceMemory:
    """The address ranges that count as the NPU's own memory (its host tensors).

    On a real NPU they come from the default remote context
    (``core.get_default_context("NPU").create_host_tensor``); under the double they are
    page-aligned host arrays the double treats the same way.  :meth:`holds` is the half of
    NPUW's input rule that asks where a tensor lies."""

    def __init__(self, context: ov.RemoteContext | None = None, *, device: bool = False) -> None:
        """``context``: allocate through it (a real NPU); ``device``: the double's arrays count
        as device memory; neither: host memory, which an NPU copies."""
        self._context = context
        self.device = device or context is not None
        self._ranges: list[tuple[int, int]] = []
        self._kept: list[object] = []  # the tensors whose memory the arrays are

    def zeros(self, count: int, dtype: np.dtype) -> np.ndarray:
        """``count`` zeroed elements, page-aligned, from the device's allocator when there is
        one.  The cache's buffers come from here."""
        if self._context is not None:
            element = ov.Type(dtype)
            tensor = self._context.create_host_tensor(element, ov.Shape([count]))
            array = np.asarray(tensor.data).view(dtype).reshape(-1)
            array[...] = 0
            self._kept.append(tensor)
        else:
            array = aligned_zeros(count, dtype)
        if self.device:
            start = int(array.ctypes.data)
            self._ranges.append((start, start + array.nbytes))
        return array

    def holds(self, tensor: ov.Tensor) -> bool:
        """Whether ``tensor`` lies wholly in memory from :meth:`zeros` (device memory)."""
        if not self._ranges or tensor.byte_size == 0:
            return False
        start = address(tensor)
        strides, shape = tensor.get_strides(), tensor.get_shape()
        end = start + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
        end += tensor.get_element_type().size
        return any(a <= start and end <= b for a, b in self._ranges)


def input_copied(tensor: ov.Tensor, memory: DeviceMemory, strided: bool = False) -> bool:
    """NPUW's rule for a global input of an NPU sub-model: copied unless it lies in device
    memory and is contiguous, or its port has strides enabled (``strided``)."""
    dense = strided or tensor.is_continuous()
    return tensor.byte_size > 0 and not (dense and memory.holds(tensor))


def output_copied(tensor: ov.Tensor, memory: DeviceMemory) -> bool:
    """The plugin's rule for an (accepted, contiguous) output: written in place in device
    memory or in page-aligned host memory it imports, else staged and copied back."""
    return tensor.byte_size > 0 and not (memory.holds(tensor) or page_aligned(tensor))


def copied_bytes(
    inputs: Iterable[tuple[ov.Tensor, bool]], outputs: Iterable[ov.Tensor], memory: DeviceMemory
) -> int:
    """The bytes an NPU would copy around one call with these tensors bound, each input with
    whether its port has strides enabled (an estimate by the rules above: what NPUW and the
    plugin do with each, not a measurement)."""
    moved = sum(t.byte_size for t, strided in inputs if input_copied(t, memory, strided))
    return moved + sum(t.byte_size for t in outputs if output_copied(t, memory))
