"""What the NPU path's statistics add to a static runner's: who enforces an NPU's I/O rules,
how outputs are bound, what an NPU would copy, and where each model runs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..compile import Requests
    from .runner import StaticRunner


def npu_stats(runner: StaticRunner) -> dict[str, Any]:
    """On the NPU path: who enforces an NPU's I/O rules, whether strided outputs are bound,
    and what an NPU copies by those rules since the last prompt (an estimate; the double,
    where it runs, counts the same calls itself)."""
    io = runner.requests.npu_io
    if io is None:
        return {}
    stats: dict[str, Any] = {
        "npu_io": io.enforced_by,
        "strided_outputs": "direct" if runner.generate_binding.strided_outputs else "staged",
        # NPU_ENABLE_STRIDES_FOR on the KV ports: chosen by npuw-kv, given, or none
        "kv_strides": (
            ("chosen" if io.strides_chosen else "given") if io.strided_ports else "none"
        ),
        "npu_copied_bytes_estimate": runner.calls.estimate,
        # of host_bytes_copied: the staged outputs' rows (strided outputs staged)
        "staged_output_bytes": sum(m.binding.staged_output_bytes for m in runner.calls.models),
        "npu_prefill_copied_bytes_estimate": runner.prefill_npu_estimate,
        "npu_kv_memory": "device" if io.memory.device else "host",
        "submodel_devices": _submodel_devices(runner.requests),
    }
    if runner.calls.refused:
        stats["strided_output_refused"] = runner.calls.refused
    if io.double is not None:
        stats["double_copied_bytes"] = io.double.bytes
    return stats


def _submodel_devices(requests: Requests) -> dict[str, str]:
    """Where each model of the NPU path runs: the static models where NPUW was allowed to
    place their sub-models (runtime/npu_compile.py), the cut-out embedding and head where
    they were compiled."""
    placed = {"prefill": requests.npuw_placement, "generate": requests.npuw_placement}
    for name, request in (("embed", requests.embed), ("head", requests.head)):
        if request is not None:
            devices = request.get_compiled_model().get_property("EXECUTION_DEVICES")
            placed[name] = devices if isinstance(devices, str) else ",".join(devices)
    return placed
