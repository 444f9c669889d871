"""What a device is asked for: the plugin's properties, and the precisions K/V are computed
and stored in.

On NPU the static models share one NPUW weights bank (folded functions); the CPU's compute
precision decides what ``kv_precision="auto"`` stores; a PagedAttention compile gets its KV
precision and small per-shape caches here.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import openvino as ov

from ..config.pipeline_config import PipelineConfig

_BANKS = itertools.count()


def _type_name(hint: Any) -> str:
    """An element-type hint (``ov.Type`` or a string) as a lower-case name, e.g. "bf16"."""
    return (hint.get_type_name() if isinstance(hint, ov.Type) else str(hint)).lower()


def device_properties(
    core: ov.Core, config: PipelineConfig, wide_activations: bool = False
) -> tuple[str, dict[str, Any]]:
    """The plugin name and its properties for ``config.device``.

    On NPU the two static models share their weights the way NPUW's own LLM pipeline does:
    ``NPUW_FOLD`` turns the repeated layers into one function whose weights are inputs held in
    a weights bank, and one ``NPUW_WEIGHTS_BANK`` per pipeline lets prefill and generate read
    the same bank (measured on SmolLM2: peak RSS 1345 -> 804 MB).  ``NPUW_FUNCALL_FOR_ALL``
    makes every sub-graph a function, so the weights outside the repeated layers go to the bank
    too; without it NPUW cannot fold optimum-intel's fp16 export at all ("unordered_map::at")
    and each static model holds its own weights (SmolLM2 fp16, 1k bench: 2301 -> 1110 MB peak
    RSS, NPUW's own LLM pipeline 1138 MB).  An f32 precision hint also
    turns off NPUW's f16 tensors between sub-graphs (``NPUW_F16IC``), which otherwise round the
    result (|dlogit| 3e-2 -> 5e-5); so does a model whose activations leave the f16 range
    (``wide_activations``, :func:`~npuw_kv.model.source.wide_activations`), where they would
    overflow to NaN.  Any of these set explicitly wins.
    """
    props: dict[str, Any] = {}
    if config.device == "NPU":
        props.update(
            {
                "NPU_USE_NPUW": "YES",
                "NPUW_DEVICES": npuw_devices(core, config),
                "NPUW_FOLD": "YES",
                "NPUW_FUNCALL_FOR_ALL": "YES",
                "NPUW_WEIGHTS_BANK": f"npuw_kv_{next(_BANKS)}",
            }
        )
        if not _npuw_f16_between_subgraphs(config, wide_activations):
            props["NPUW_F16IC"] = "NO"
    if config.num_threads and config.device == "CPU":
        props["INFERENCE_NUM_THREADS"] = config.num_threads
    props.update(config.compile_properties)
    return config.device, props


def npuw_target(core: ov.Core, config: PipelineConfig) -> str:
    """The ``NPUW_DEVICES`` the compiled models get: :func:`npuw_devices` on NPU, none else."""
    return npuw_devices(core, config) if config.device == "NPU" else ""


def npuw_devices(core: ov.Core, config: PipelineConfig) -> str:
    """Where NPUW runs its sub-models: ``npuw_devices``, except that the default (CPU) becomes
    "NPU,CPU" when a real NPU is present (use it, the CPU as fallback)."""
    if "NPU" in core.available_devices and config.npuw_devices == "CPU":
        return "NPU,CPU"
    return config.npuw_devices


def on_real_npu(devices: str) -> bool:
    """Whether an ``NPUW_DEVICES`` list places the sub-models on an NPU first."""
    return devices.upper().split(",")[0].strip().split(".")[0] == "NPU"  # NPU, NPU.0, ...


def _npuw_f16_between_subgraphs(config: PipelineConfig, wide_activations: bool) -> bool:
    """Whether NPUW is left to pass f16 tensors between its sub-graphs (``NPUW_F16IC``, its
    default): not under an f32 precision hint, nor for a model whose activations leave the f16
    range.  An explicit ``NPUW_F16IC`` overrides the property set from this, not the KV
    precision chosen from it."""
    hint = _type_name(config.compile_properties.get("INFERENCE_PRECISION_HINT", ""))
    return hint not in ("f32", "float32") and not wide_activations


def compute_precision(core: ov.Core, config: PipelineConfig) -> str:
    """What the device computes K/V in: "bf16", "f16" or "f32" (the hint, if it can be met)."""
    if config.device != "CPU":
        return "f32"
    hint = config.compile_properties.get("INFERENCE_PRECISION_HINT")
    if hint is None:
        hint = core.get_property("CPU", "INFERENCE_PRECISION_HINT")
    precision = {"bf16": "bf16", "bfloat16": "bf16", "f16": "f16", "float16": "f16"}.get(
        _type_name(hint), "f32"
    )
    # a hint the hardware cannot honour falls back to f32 compute
    capabilities = core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    return precision if precision.upper() in capabilities or precision == "f32" else "f32"


def resolve_kv_precision(
    core: ov.Core, config: PipelineConfig, wide_activations: bool = False
) -> str:
    """``auto``: store KV in the precision the device computes it in.

    On NPU that is f16, as NPUW's own LLM pipeline stores it (a real NPU computes in f16),
    except where our settings keep NPUW's tensors f32: under an f32 precision hint and for
    models whose activations leave the f16 range (``wide_activations``).  With NPUW running its
    sub-models on the CPU too: since the f16 past and the new KV are joined before the upcast
    (``transforms._join_stored``), an f16 model no longer holds an f32 copy of its past, so
    f16 KV costs less memory than f32 at 1k as well as at 4k (SmolLM2 fp16, lean ladders: peak
    871 -> 850 MB at 1k, 1072 -> 968 MB at 4k, where TTFT fell 0.94-0.95x; docs/measurements.md).
    Nor does it cost accuracy there: with NPUW's f16 tensors between sub-graphs the new K/V
    reach the cache already rounded to f16 (identical device-default rows, docs/accuracy.md).

    The CPU plugin with a bf16 (or f16) inference precision produces K/V in that type and
    converts them to f32 only at the output, and converts f32 inputs back on every step; storing
    them as bf16 is therefore lossless (bit-identical logits, tested) and halves the cache and
    the per-step conversions.  Elsewhere ``auto`` means f32.
    """
    if config.kv_precision == "bf16" and compute_precision(core, config) == "f32":
        warnings.warn(
            "kv_precision='bf16' under f32 compute keeps 8 mantissa bits where 'f16' keeps 11 "
            "for the same memory (on the 4k accuracy prompt bf16 KV leaves the f32 greedy path "
            "at token 60, f16 KV does not); the CPU plugin itself stores f32 KV under the f32 "
            "hint. Use kv_precision='f16' for 16-bit KV with f32 compute",
            RuntimeWarning,
            stacklevel=3,
        )
    if config.kv_precision != "auto":
        return config.kv_precision
    if config.device == "NPU":
        return "f16" if _npuw_f16_between_subgraphs(config, wide_activations) else "f32"
    return compute_precision(core, config)


def paged_kv_precision(config: PipelineConfig) -> str | None:
    """The ``KV_CACHE_PRECISION`` to ask of a PagedAttention compile, or None for the plugin's.

    ``auto`` leaves the plugin's default (u8 blocks on CPU, as openvino-genai runs), except
    under an explicit f32 compute hint: asking for exact compute means exact KV too.
    """
    if config.kv_precision != "auto":
        return config.kv_precision
    hint = config.compile_properties.get("INFERENCE_PRECISION_HINT")
    return "f32" if hint is not None and _type_name(hint) in ("f32", "fp32", "float32") else None


# executors the CPU plugin keeps per PagedAttention model (its default: 5000)
RUNTIME_CACHE_CAPACITY = 20


def limit_runtime_cache(props: dict[str, Any]) -> dict[str, Any]:
    """``props`` with the CPU plugin's per-shape executor cache kept small, unless set.

    A PagedAttention model runs chunks of every length (a prompt's last chunk, the answer's
    steps) through one dynamic-shape model, and the plugin keeps the executors it built for
    each input shape in an LRU cache (``CPU_RUNTIME_CACHE_CAPACITY``, 5000 entries), oneDNN
    their primitives in another (see ``heap.limit_primitive_cache``): about 1 MB more resident
    memory per new prompt length (SmolLM2, prompts of 20..1020 tokens: 434 -> 670 MB over 300
    calls, still rising; with both caches small: 423 -> 426 MB).  20 entries cost no speed we
    could measure (a varied-length loop, a chat, ``npuw-kv bench --quick``: within the noise,
    also with 32 or 48); the layers still share one executor per shape.  With none (0) each
    layer builds its own: +120 MB and ~35 % more CPU time.
    """
    if any(str(key).upper() == "CPU_RUNTIME_CACHE_CAPACITY" for key in props):
        return props
    return {**props, "CPU_RUNTIME_CACHE_CAPACITY": RUNTIME_CACHE_CAPACITY}
