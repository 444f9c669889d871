"""What a device is asked for: the plugin's properties.

On NPU the static models share one NPUW weights bank (folded functions); a PagedAttention
compile gets small per-shape caches here.  The precisions and devices they name were decided
in :mod:`npuw_kv.config.decide`.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import openvino as ov

from ..config.decide import Decided, on_real_npu
from ..config.pipeline_config import PipelineConfig
from ..errors import last_line
from .npu_double import DeviceCopies
from .npu_rules import DeviceMemory

_BANKS = itertools.count()
STRIDES = "NPU_ENABLE_STRIDES_FOR"  # the ports compiled with strides (runtime/npu_strides.py)


def device_properties(decided: Decided[PipelineConfig]) -> tuple[str, dict[str, Any]]:
    """The plugin name and its properties for the device of ``decided``.

    On NPU the two static models share their weights the way NPUW's own LLM pipeline does:
    ``NPUW_FOLD`` turns the repeated layers into one function whose weights are inputs held in
    a weights bank, and one ``NPUW_WEIGHTS_BANK`` per pipeline lets prefill and generate read
    the same bank (one copy of the weights, not one per model).  ``NPUW_FUNCALL_FOR_ALL``
    makes every sub-graph a function, so the weights outside the repeated layers go to the bank
    too; without it NPUW cannot fold optimum-intel's fp16 export at all ("unordered_map::at")
    and each static model holds its own weights.  An f32 precision hint also
    turns off NPUW's f16 tensors between sub-graphs (``NPUW_F16IC``), which otherwise round the
    result; so does a model whose activations leave the f16 range
    (:func:`~npuw_kv.model.families.wide_activations`), where they would overflow to NaN
    (``Decided.npuw_f16``).  ``NPUW_DQ`` applies a channel-wise compressed weight's scale
    after its MatMul instead of to the weight (NPUW's own LLM pipeline sets it for both phases
    of such a model; it changes nothing on models it does not match, such as SmolLM2 Q4_1's
    groups).  Any of these set explicitly wins.  The figures behind each: docs/measurements.md,
    "Figures behind the code's choices".
    """
    config = decided.config
    props: dict[str, Any] = {}
    if config.device == "NPU":
        props.update(
            {
                "NPU_USE_NPUW": "YES",
                "NPUW_DEVICES": decided.npuw_devices,
                "NPUW_FOLD": "YES",
                "NPUW_FUNCALL_FOR_ALL": "YES",
                "NPUW_WEIGHTS_BANK": f"npuw_kv_{next(_BANKS)}",
                "NPUW_DQ": "YES",
            }
        )
        if not decided.npuw_f16:
            props["NPUW_F16IC"] = "NO"
    if config.num_threads and config.device == "CPU":
        props["INFERENCE_NUM_THREADS"] = config.num_threads
    props.update(config.compile_properties)
    if config.device == "NPU":  # a CPU plugin setting: on the core (compile.compile_requests)
        props.pop("SNIPPETS_MODE", None)
        if str(props.get(STRIDES, "x")).strip() == "":  # "": no strides, and none chosen
            props.pop(STRIDES)
        elif decided.kv_strides and STRIDES not in props:
            props[STRIDES] = decided.kv_strides
    return config.device, props


# executors the CPU plugin keeps per PagedAttention model (its default: 5000)
RUNTIME_CACHE_CAPACITY = 20


def limit_runtime_cache(props: dict[str, Any]) -> dict[str, Any]:
    """``props`` with the CPU plugin's per-shape executor cache kept small, unless set.

    A PagedAttention model runs chunks of every length (a prompt's last chunk, the answer's
    steps) through one dynamic-shape model, and the plugin keeps the executors it built for
    each input shape in an LRU cache (``CPU_RUNTIME_CACHE_CAPACITY``, 5000 entries), oneDNN
    their primitives in another (see ``heap.limit_primitive_cache``): resident memory grows
    with every new prompt length.  20 entries cost no speed we could measure, and the layers
    still share one executor per shape; with none (0) each layer builds its own, which costs
    both memory and time (the figures: docs/measurements.md, "Figures behind the code's
    choices").
    """
    if any(str(key).upper() == "CPU_RUNTIME_CACHE_CAPACITY" for key in props):
        return props
    return {**props, "CPU_RUNTIME_CACHE_CAPACITY": RUNTIME_CACHE_CAPACITY}


def npu_present() -> bool:
    """Whether OpenVINO sees a real NPU (without one, NPUW runs its sub-models on the CPU)."""
    return "NPU" in ov.Core().available_devices


def resolve_device(name: str) -> str:
    """``auto``: this machine's NPU when OpenVINO sees one, else its CPU (what each replica of
    ``npuw-kv serve --ray`` decides on its own machine); any other name as given."""
    if str(name).strip().upper() != "AUTO":
        return name
    return "NPU" if npu_present() else "CPU"


@dataclass(kw_only=True)
class NpuIO:
    """How the NPU path's requests meet an NPU's I/O rules (:mod:`.npu_rules`): where the KV
    memory comes from, whether strided output views are bound or staged, and who enforces
    the rules: a real NPU, the double (:mod:`.npu_double`, ``npu_io_double``) or nobody (NPUW's
    CPU stand-in, which takes whatever a CPU request takes)."""

    memory: DeviceMemory
    strided_outputs: bool
    enforced_by: str  # "NPU", "double" or "none (CPU stand-in)"
    strided_ports: frozenset[str] = frozenset()  # NPU_ENABLE_STRIDES_FOR compiled with
    strides_chosen: bool = False  # by npuw-kv (runtime/npu_strides.py), not given
    double: DeviceCopies | None = None  # what the double counted

    def describe(self) -> str:
        """One line for ``npuw-kv inspect``: who enforces the rules, what that means here."""
        outputs = "strided outputs bound" if self.strided_outputs else "strided outputs staged"
        if self.strides_chosen:
            outputs += f" ({STRIDES} chosen for the {len(self.strided_ports)} KV port names)"
        memory = (
            "KV in the device's memory (dense pasts read in place)"
            if self.memory.device
            else "KV in host memory (an NPU would copy every past before each call)"
        )
        return f"rules enforced by {self.enforced_by}; {outputs}; {memory}"


def npu_io(
    core: ov.Core, decided: Decided[PipelineConfig], compiled_with: Mapping[str, Any]
) -> NpuIO | None:
    """The NPU I/O of ``decided``'s static models, compiled with the properties
    ``compiled_with`` (None off the NPU path).

    A real NPU (NPUW places sub-models on it) refuses strided outputs unless strides were
    enabled for them (``NPU_ENABLE_STRIDES_FOR``, given or chosen: then they are bound, and a
    refusal at the first infer still falls back to staging), and its KV comes from the NPU's
    default context, where NPUW reads contiguous inputs in place."""
    config = decided.config
    if config.device != "NPU" or not decided.static_models:
        return None
    value = str(compiled_with.get(STRIDES, ""))
    ports = frozenset(name.strip() for name in value.split(",") if name.strip())
    chosen = bool(ports) and value == decided.kv_strides
    if config.npu_io_double:
        return NpuIO(
            memory=DeviceMemory(device=True),
            strided_outputs=bool(ports),
            enforced_by="double",
            strided_ports=ports,
            strides_chosen=chosen,
            double=DeviceCopies(),
        )
    if not on_real_npu(decided.npuw_devices):
        return NpuIO(memory=DeviceMemory(), strided_outputs=True, enforced_by="none (CPU stand-in)")
    try:
        context = core.get_default_context("NPU")
    except RuntimeError as exc:  # an NPU listed but no context: host memory, copied by NPUW
        warnings.warn(
            f"the NPU's memory is out of reach ({last_line(exc)}): the KV cache is host memory, "
            "which NPUW copies into the NPU's before every call",
            RuntimeWarning,
            stacklevel=3,
        )
        context = None
    return NpuIO(
        memory=DeviceMemory(context),
        strided_outputs=bool(ports),
        enforced_by="NPU",
        strided_ports=ports,
        strides_chosen=chosen,
    )
