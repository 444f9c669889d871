"""A double of the NPU plugin's I/O rules, for NPUW's CPU stand-in.

NPUW with its sub-models on the CPU accepts whatever a CPU request accepts: strided outputs,
host memory anywhere.  A real NPU does not (:mod:`.npu_rules`).  :class:`NpuRulesRequest`
wraps each compiled request of the NPU path (``npu_io_double``) and applies the rules at
``infer()``, where NPUW applies them: a strided output of a port not compiled with strides
fails with the plugin's message, a zero-size input fails, and every input or output the NPU
would copy is counted in :class:`DeviceCopies`.  The CPU request then runs as before, so the
tokens are the stand-in's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import openvino as ov

from .npu_rules import STRIDED_REFUSED, DeviceMemory, input_copied, output_copied

if TYPE_CHECKING:
    from .compile import Requests
    from .device import NpuIO


class DeviceCopies:
    """What the double saw an NPU copy: bytes and tensors, since the last :meth:`reset`."""

    def __init__(self) -> None:
        self.bytes = 0
        self.tensors = 0
        self.calls = 0

    def reset(self) -> None:
        self.bytes = self.tensors = self.calls = 0


class NpuRulesRequest:
    """An infer request of the CPU stand-in that refuses and counts what an NPU would.

    Everything but ``infer`` goes to the wrapped request unchanged; ``infer`` first checks the
    tensors bound to each port, as NPUW's prologue hands them to an NPU sub-request."""

    def __init__(
        self,
        request: ov.InferRequest,
        memory: DeviceMemory,
        copies: DeviceCopies,
        strided_ports: frozenset[str] = frozenset(),
    ) -> None:
        self.request = request
        self.memory = memory
        self.copies = copies
        self.strided_ports = strided_ports  # NPU_ENABLE_STRIDES_FOR
        compiled = request.get_compiled_model()
        self.inputs = list(compiled.inputs)
        self.outputs = list(compiled.outputs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.request, name)

    def infer(self, *args: Any) -> Any:
        for port in self.outputs:
            tensor = self.request.get_tensor(port)
            if not tensor.is_continuous() and not port.get_names() & self.strided_ports:
                raise RuntimeError(
                    f"{STRIDED_REFUSED} (custom strides), output {port.get_any_name()!r} "
                    f"shape {list(tensor.get_shape())} strides {list(tensor.get_strides())}: "
                    "enable strides for this port with NPU_ENABLE_STRIDES_FOR (npuw-kv's NPU "
                    "rules double, after ZeroInferRequest::check_tensor)"
                )
        moved = tensors = 0
        for port in self.inputs:
            tensor = self.request.get_tensor(port)
            if tensor.byte_size == 0:
                raise RuntimeError(
                    f"input {port.get_any_name()!r} has zero size {list(tensor.get_shape())}: "
                    "an NPU compile strips such inputs (npuw-kv's NPU rules double)"
                )
            if input_copied(tensor, self.memory, bool(port.get_names() & self.strided_ports)):
                moved, tensors = moved + tensor.byte_size, tensors + 1
        for port in self.outputs:
            tensor = self.request.get_tensor(port)
            if output_copied(tensor, self.memory):
                moved, tensors = moved + tensor.byte_size, tensors + 1
        self.copies.bytes += moved
        self.copies.tensors += tensors
        self.copies.calls += 1
        return self.request.infer(*args)


def with_npu_io(requests: Requests, io: NpuIO | None) -> Requests:
    """``requests`` carrying their NPU I/O; under the double, each NPU request (the static
    models; the embedding and head run on the CPU plugin) wrapped in it."""
    if io is None:
        return requests
    copies = io.double
    if copies is not None:

        def wrap(request: ov.InferRequest) -> Any:
            return NpuRulesRequest(request, io.memory, copies, io.strided_ports)

        def ladder(variants: tuple[Any, ...]) -> tuple[Any, ...]:
            return tuple(replace(v, request=wrap(v.request)) for v in variants)

        requests = replace(
            requests,
            prefill=wrap(requests.prefill),
            generate=wrap(requests.generate),
            prefill_ladder=ladder(requests.prefill_ladder),
            generate_ladder=ladder(requests.generate_ladder),
            packed=ladder(requests.packed),
        )
    return replace(requests, npu_io=io)
