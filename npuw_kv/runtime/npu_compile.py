"""Compiling for a real NPU: the NPU alone first, and a missing driver or compiler named.

With ``NPUW_DEVICES=NPU,CPU`` NPUW compiles a sub-model the NPU refuses for the CPU instead and
says nothing: its compiled model reports ``EXECUTION_DEVICES`` ``NPU`` whatever runs where
(``npuw/compiled_model.cpp``), and release builds expose no per-sub-model device.  So the
static models compile for the NPU alone first; the CPU is reached for only after a warning
that says why, and the requests record where NPUW was allowed to place its sub-models.

A missing NPU compiler or driver fails every NPU compile the same way.  It is one
:class:`~npuw_kv.errors.CompileError` naming the missing piece and where it comes from, raised
after the first compile, not read as "NPUW could not fold this model" and compiled again.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from ..config.decide import Decided, on_real_npu
from ..config.pipeline_config import PipelineConfig
from ..errors import CompileError, UsageError, last_line

if TYPE_CHECKING:  # compile.py reads missing_npu from here
    from .compile import Requests

# where the NPU compiler library comes from (the doctor's report says it too)
COMPILER_SOURCES = (
    "OpenVINO's archive packages (2026.0 and later: Compiler-In-Plugin) and Intel's NPU "
    "driver (linux-npu-driver releases) ship it; the PyPI `openvino` wheel does not"
)
# what a failed NPU compile says -> the missing piece, and where it comes from
_MISSING = (
    (
        "npu_compiler_loader",
        "the NPU compiler (libopenvino_intel_npu_compiler_loader.so and "
        "libopenvino_intel_npu_compiler.so beside the NPU plugin)",
        COMPILER_SOURCES,
    ),
    (
        "Could not find an NPU device",
        "an NPU device (NPU_COMPILER_TYPE=DRIVER compiles on the device's driver)",
        "Intel's NPU driver (linux-npu-driver) with an Intel NPU",
    ),
    (
        "No available backend",
        "the NPU driver (the Level Zero backend, libze_loader.so.1)",
        "Intel's NPU driver (linux-npu-driver) and the Level Zero loader",
    ),
    (
        "Level zero backend is not found",
        "the NPU driver (the Level Zero backend, libze_loader.so.1)",
        "Intel's NPU driver (linux-npu-driver) and the Level Zero loader",
    ),
)


def missing_npu(exc: BaseException) -> CompileError | None:
    """The error to raise when ``exc`` says an NPU compile lacks its compiler or driver."""
    text = str(exc)
    for mark, piece, source in _MISSING:
        if mark in text:
            return CompileError(
                f"the NPU cannot compile here: {piece} is missing ({last_line(exc)}). {source}. "
                "Without them, run NPUW's sub-models on the CPU: npuw_devices='CPU' "
                "(NPUW_DEVICES), or use device='CPU'"
            )
    return None


def placement_plan(devices: str) -> str:
    """Where NPUW will be let place the static models' sub-models (``npuw-kv inspect``)."""
    names = [name.strip() for name in devices.split(",") if name.strip()]
    if not on_real_npu(devices):
        return f"{devices}: every sub-model on the {names[0]} (NPUW without an NPU: the stand-in)"
    if len(names) == 1:
        return f"{names[0]}: every sub-model on the {names[0]}; one it cannot compile is an error"
    return (
        f"{names[0]} alone first; only where it refuses a sub-model, {devices} after a warning "
        "(OpenVINO does not say which sub-models then run elsewhere)"
    )


def compile_npu_first(
    compile_: Callable[[Decided[PipelineConfig]], Requests], decided: Decided[PipelineConfig]
) -> Requests:
    """``compile_(decided)``, on a device list that starts with an NPU and goes on (``NPU,CPU``)
    first with the NPU alone; the requests say where NPUW could place the sub-models."""
    devices = decided.npuw_devices
    names = [name.strip() for name in devices.split(",") if name.strip()]
    if not on_real_npu(devices) or len(names) == 1:
        requests = _or_missing(compile_, decided)
        return replace(requests, npuw_placement=devices or decided.config.device)
    try:
        requests = _or_missing(compile_, replace(decided, npuw_devices=names[0]))
        return replace(requests, npuw_placement=names[0])
    except CompileError:
        raise
    except (RuntimeError, UsageError) as exc:
        reason = last_line(exc)
    warnings.warn(
        f"the {names[0]} could not compile every sub-model alone ({reason}); compiling with "
        f"NPUW_DEVICES={devices}, so NPUW runs the sub-models the {names[0]} refuses on "
        f"{', '.join(names[1:])}, and OpenVINO does not say which (EXECUTION_DEVICES reports "
        f"{names[0]}); set npuw_devices='{names[0]}' to make this an error",
        RuntimeWarning,
        stacklevel=3,
    )
    requests = compile_(decided)
    return replace(requests, npuw_placement=f"{devices} (the {names[0]} alone failed: {reason})")


def _or_missing(
    compile_: Callable[[Decided[PipelineConfig]], Requests], decided: Decided[PipelineConfig]
) -> Requests:
    try:
        return compile_(decided)
    except RuntimeError as exc:
        error = missing_npu(exc) if decided.config.device == "NPU" else None
        if error is not None:
            raise error from exc
        raise
