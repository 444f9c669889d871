"""Every ``auto`` setting decided, here and nowhere else.

A :class:`~npuw_kv.config.pipeline_config.PipelineConfig` keeps what the user gave, ``auto``
included.  :func:`decide` turns it, the device and the model's one relevant fact (activations
beyond the f16 range) into a :class:`Decided`: the attention backend, static models or one
dynamic model, where NPUW runs, the compute and KV precisions, V transposed or not, rings for
sliding-window layers, which pyramid ladders, KV blocks.  The builders read only that;
``npuw-kv inspect`` prints it.

The functions that need no device are used by the configuration's own validation too (which
settings clash depends on whether ``auto`` picks PagedAttention).  What a model's graph refuses
at build time (a rewrite that does not match, a variant that does not reshape, PagedAttention
that does not compile) is a fallback the builder takes and records on its copy of the settings,
not a decision made here.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from .settings import MAX_NUM_SEQS, _as_bool

if TYPE_CHECKING:
    import openvino as ov


class Settings(Protocol):
    """The settings the decisions read: fields of
    :class:`~npuw_kv.config.pipeline_config.PipelineConfig`, whose own validation uses these
    rules (which settings clash depends on what ``auto`` picks) without importing this module's
    caller back."""

    @property
    def device(self) -> str: ...
    @property
    def attention_backend(self) -> str: ...
    @property
    def static_models(self) -> bool | None: ...
    @property
    def kv_binding(self) -> str: ...
    @property
    def kv_precision(self) -> str: ...
    @property
    def window_kv(self) -> str: ...
    @property
    def prefix_cache_tokens(self) -> int: ...
    @property
    def prefill_attention(self) -> str: ...
    @property
    def generate_pyramid(self) -> bool | None: ...
    @property
    def optimize_v_tensors(self) -> bool | None: ...
    @property
    def npuw_devices(self) -> str: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_prompt_len(self) -> int: ...
    @property
    def min_response_len(self) -> int: ...
    @property
    def compile_properties(self) -> dict[str, Any]: ...


C = TypeVar("C", bound=Settings)


def paged(config: Settings) -> bool:
    """Whether attention runs as the CPU plugin's PagedAttention over a paged cache.

    ``auto`` picks it on CPU (the least memory: u8 KV blocks and no attention buffers sized by
    the chunk) unless a setting only the static-shape path honours is given: two static models,
    copy binding, or a KV precision named explicitly (the plugin's paged kernel stores KV as u8
    or in its compute precision only).
    """
    if config.attention_backend != "auto":
        return config.attention_backend == "pa"
    return (
        config.device == "CPU"
        and config.static_models is not True
        and config.kv_binding == "roi"
        and config.kv_precision in ("auto", "u8")
    )


def scheduled_attention(config: Settings) -> str:
    """The attention backend when genai's ``SchedulerConfig`` is given: a scheduler means
    PagedAttention, so ``auto`` on CPU is ``pa`` even where a setting would keep it static (a
    KV precision its kernel cannot store with the compute precision is then refused when
    compiling, naming both settings); any other choice stays as given."""
    if config.attention_backend == "auto" and config.device == "CPU":
        return "pa"
    return config.attention_backend


def static_models(config: Settings) -> bool:
    """Two static models (NPUW's way, and the only one on NPU) or one dynamic model (CPU)."""
    return config.static_models if config.static_models is not None else config.device != "CPU"


# the packed generate models' sizes below max_num_seqs (model/packed.py): sequences at once
PACKED_RUNGS = (4, 16, 64)
# under the default max_num_seqs, the slots times one sequence's capacity stay within this many
# tokens: a packed model holds the concatenated past of all its slots in every layer (a 16k
# context's 16 slots: ~2 GB more on the 1B stand-in; docs/measurements.md)
PACKED_SLOT_TOKENS = 16 * 2048


def packed_slots(config: Settings) -> tuple[int, ...]:
    """How many sequences each packed generate model steps at once, ascending (empty: one
    sequence at a time).  The static models' path (NPU) with ``max_num_seqs`` > 1: a model
    for each of 4, 16, 64 below it and one for it, so a step runs the smallest
    model that holds the live sequences (16: models of 4 and 16 sequences).  The default
    ``max_num_seqs`` stands for as many as ``PACKED_SLOT_TOKENS`` hold (16 up to a 2k
    capacity, 7 at 4k, 2 at 16k).  Not with V
    stored transposed, asked for (``optimize_v_tensors``), which a packed model does not read:
    then one sequence at a time (both asked for is refused: ``PipelineConfig``)."""
    top = config.max_num_seqs
    if top == MAX_NUM_SEQS:  # the default: as many as PACKED_SLOT_TOKENS of capacity hold
        top = min(top, PACKED_SLOT_TOKENS // (config.max_prompt_len + config.min_response_len))
    if not static_models(config) or top < 2 or config.optimize_v_tensors:
        return ()  # V transposed, asked for: not read by a packed model (one at a time)
    return (*(r for r in PACKED_RUNGS if r < top), top)


def window_rings(config: Settings) -> bool:
    """Whether the static-shape path keeps sliding-window layers' KV in rings (``window_kv``;
    ``auto``: unless the host prefix store wants every layer's whole past)."""
    return config.window_kv == "ring" or (
        config.window_kv == "auto" and not config.prefix_cache_tokens
    )


def prefill_ladder(config: Settings) -> str:
    """The static prefill models: ``"one"`` (the whole past), ``"lean"`` (``auto``: only the
    variants that pay for their memory) or ``"full"`` (an explicit ``pyramid``)."""
    if not static_models(config) or config.prefill_attention == "static":
        return "one"
    return "lean" if config.prefill_attention == "auto" else "full"


def generate_ladder(config: Settings) -> str:
    """The static generate models, as :func:`prefill_ladder` (``generate_pyramid`` None: lean)."""
    if not static_models(config) or config.generate_pyramid is False:
        return "one"
    return "lean" if config.generate_pyramid is None else "full"


def on_real_npu(devices: str) -> bool:
    """Whether an ``NPUW_DEVICES`` list places the sub-models on an NPU first."""
    return devices.upper().split(",")[0].strip().split(".")[0] == "NPU"  # NPU, NPU.0, ...


def npuw_uses_cpu(devices: str) -> bool:
    """Whether an ``NPUW_DEVICES`` list lets NPUW run sub-models on the CPU plugin."""
    return "CPU" in (d.strip() for d in devices.upper().split(","))


def v_transposed(config: Settings, npuw_devices: str) -> bool:
    """Whether the static models store V transposed (``optimize_v_tensors``).

    ``auto`` (None): only where NPUW places the models on a real NPU, as NPUW's own default
    (YES) is meant for.  With NPUW on the CPU, the transposed V measured no faster on SmolLM2
    (docs/design.md, "V stored transposed"), so it stays off there.
    """
    if not static_models(config):
        return False
    if config.optimize_v_tensors is not None:
        return config.optimize_v_tensors
    if packed_slots(config):  # a packed model reads V as [1, H, S, D] (model/packed.py)
        return False
    return on_real_npu(npuw_devices)


def type_name(hint: Any) -> str:
    """An element-type hint (``ov.Type`` or a string) as a lower-case name, e.g. "bf16"."""
    get = getattr(hint, "get_type_name", None)
    return (get() if callable(get) else str(hint)).lower()


def npuw_f16_between_subgraphs(config: Settings, wide_activations: bool) -> bool:
    """Whether NPUW is left to pass f16 tensors between its sub-graphs (``NPUW_F16IC``, its
    default): not under an f32 precision hint, nor for a model whose activations leave the f16
    range.  An explicit ``NPUW_F16IC`` overrides the property set from this, not the KV
    precision chosen from it."""
    hint = type_name(config.compile_properties.get("INFERENCE_PRECISION_HINT", ""))
    return hint not in ("f32", "float32") and not wide_activations


def npuw_f16_tensors(config: Settings, wide_activations: bool, stored: str | None) -> bool:
    """``NPUW_F16IC`` as the NPU path compiles with it: as given, else
    :func:`npuw_f16_between_subgraphs`, and off under an f32 KV cache (asked for to keep
    values exact; with f16 tensors between sub-graphs NPUW also hands some models' f32 KV
    inputs to a sub-graph compiled for f16: "ParameterMismatch" at the first call)."""
    given = config.compile_properties.get("NPUW_F16IC")
    if given is not None:
        return _as_bool("NPUW_F16IC", given)
    return npuw_f16_between_subgraphs(config, wide_activations) and stored != "f32"


def cpu_snippets_off(core: ov.Core, config: Settings, devices: str, f16_between: bool) -> bool:
    """Whether NPUW's CPU sub-models compile without the CPU plugin's snippets
    (``SNIPPETS_MODE=DISABLE`` on the pipeline's core): where they compute in bf16 and take f32
    tensors from the sub-graph before (``NPUW_F16IC`` off).  The plugin's fused bf16 attention
    (OpenVINO 2026.4) then reads an f32 mask input of one row (``[1, 1, 1, S]``, every generate
    step) wrong for some head and past sizes: NaN in a test graph, wrong tokens from the first
    step on the tiny Gemma 2 and Phi-2 (docs/npuw-notes.md).  With f16 tensors between the
    sub-graphs, or f32 compute, it is right; without snippets the step costs some time, f32
    compute far more (docs/measurements.md, "NPUW on the CPU without snippets").
    An explicit ``SNIPPETS_MODE`` is set on the core as given."""
    if not npuw_uses_cpu(devices):
        return False
    given = config.compile_properties.get("SNIPPETS_MODE")
    if given is not None:
        return str(given).upper() == "DISABLE"
    if f16_between:
        return False
    return cpu_precision(core, config) == "bf16"


def paged_kv_precision(config: Settings) -> str | None:
    """The ``KV_CACHE_PRECISION`` to ask of a PagedAttention compile, or None for the plugin's.

    ``auto`` leaves it to the plugin, as openvino-genai's pipeline does: the IR's runtime
    option (f16 in optimum-intel's exports), else its default (u8 blocks on CPU); except under
    an explicit f32 compute hint: asking for exact compute means exact KV too.
    """
    if config.kv_precision != "auto":
        return config.kv_precision
    hint = config.compile_properties.get("INFERENCE_PRECISION_HINT")
    return "f32" if hint is not None and type_name(hint) in ("f32", "fp32", "float32") else None


def npuw_devices(core: ov.Core, config: Settings) -> str:
    """Where NPUW runs its sub-models (``""`` off NPU): ``npuw_devices``, except that the
    default (CPU) becomes "NPU,CPU" when a real NPU is present (use it, the CPU as fallback)."""
    if config.device != "NPU":
        return ""
    if "NPU" in core.available_devices and config.npuw_devices == "CPU":
        return "NPU,CPU"
    return config.npuw_devices


def compute_precision(core: ov.Core, config: Settings) -> str:
    """What the device computes K/V in: "bf16", "f16" or "f32" (the hint, if it can be met)."""
    if config.device != "CPU":
        return "f32"
    return cpu_precision(core, config)


def cpu_precision(core: ov.Core, config: Settings) -> str:
    """What the CPU plugin computes in under ``config``'s hint (on NPU: NPUW's CPU sub-models)."""
    hint = config.compile_properties.get("INFERENCE_PRECISION_HINT")
    if hint is None:
        hint = core.get_property("CPU", "INFERENCE_PRECISION_HINT")
    precision = {"bf16": "bf16", "bfloat16": "bf16", "f16": "f16", "float16": "f16"}.get(
        type_name(hint), "f32"
    )
    # a hint the hardware cannot honour falls back to f32 compute
    capabilities = core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    return precision if precision.upper() in capabilities or precision == "f32" else "f32"


def usable_cpus() -> int:
    """How many CPUs this process may run on (its affinity: ``taskset``, a container's
    cpuset, a Kubernetes pod's exclusive CPUs)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def one_cpu_bf16(core: ov.Core, config: Settings, devices: str) -> bool:
    """Whether the CPU plugin would compute in bf16 by its own default on a process held to
    one CPU.  OpenVINO's CPU plugin (2026.4) then dies with SIGFPE while compiling some LLM
    graphs (fp16 exports; openvino-genai's own pipeline too: openvinotoolkit/openvino#33300),
    so the pipeline computes in f32 there instead; an explicit hint is honoured."""
    if "INFERENCE_PRECISION_HINT" in config.compile_properties or usable_cpus() != 1:
        return False
    if config.device != "CPU" and not npuw_uses_cpu(devices):
        return False
    return cpu_precision(core, config) == "bf16"


def kv_precision(
    core: ov.Core, config: Settings, wide_activations: bool = False, compute: str | None = None
) -> str:
    """What the static-shape path stores KV in; ``auto``: the precision the device computes
    it in (``compute``, :func:`compute_precision`, asked of the device when not given).

    On NPU that is f16, as NPUW's own LLM pipeline stores it (a real NPU computes in f16),
    except where our settings keep NPUW's tensors f32: under an f32 precision hint and for
    models whose activations leave the f16 range (``wide_activations``).  With NPUW running its
    sub-models on the CPU too: since the f16 past and the new KV are joined before the upcast
    (``transforms._join_stored``), an f16 model no longer holds an f32 copy of its past, so
    f16 KV costs less memory than f32 at 1k as well as at 4k, and no time (docs/measurements.md,
    "f16 KV joined before the upcast").
    Nor does it cost accuracy there: with NPUW's f16 tensors between sub-graphs the new K/V
    reach the cache already rounded to f16 (identical device-default rows, docs/accuracy.md).

    The CPU plugin with a bf16 (or f16) inference precision produces K/V in that type and
    converts them to f32 only at the output, and converts f32 inputs back on every step; storing
    them as bf16 is therefore lossless (bit-identical logits, tested) and halves the cache and
    the per-step conversions.  Elsewhere ``auto`` means f32.
    """
    compute = compute or compute_precision(core, config)
    if config.kv_precision == "bf16" and compute == "f32":
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
        return "f16" if npuw_f16_between_subgraphs(config, wide_activations) else "f32"
    return compute


@dataclass(frozen=True)
class Decided(Generic[C]):
    """A pipeline's settings with every ``auto`` decided: what the builders read."""

    config: C  # as given (validated), ``auto`` included; with an f32 hint where one_cpu_bf16
    paged: bool  # PagedAttention (CPU) or the static-shape path
    static_models: bool  # static models per phase, or one dynamic model (static path)
    npuw_devices: str  # the NPUW_DEVICES the models get ("" off NPU)
    npuw_f16: bool  # NPUW passes f16 tensors between its sub-graphs (NPUW_F16IC)
    cpu_snippets_off: bool  # NPUW's CPU sub-models without the CPU plugin's snippets
    compute_precision: str  # what the device computes K/V in
    kv_precision: str | None  # what KV is stored in; None: left to the paged plugin
    v_transposed: bool  # the static models store V as [1, H, D, S]
    window_rings: bool  # sliding-window layers' KV in rings (static path)
    prefill_ladder: str  # "one", "lean" or "full"
    generate_ladder: str  # "one", "lean" or "full"
    # NPU_ENABLE_STRIDES_FOR chosen for the KV ports, once the model is read ("": none;
    # runtime/npu_strides.py): a real NPU's compiler and driver take it
    kv_strides: str = ""
    # sequences each packed generate model steps at once (static path; empty: one at a time)
    packed_slots: tuple[int, ...] = ()

    @property
    def dense_blocks(self) -> bool:
        """The static models' KV buffer cut into blocks where their pasts end (each past read
        dense, V transposed or not: an NPU reads a dense past in its memory in place, and
        copies a strided one before every call)."""
        return self.static_models

    def lines(self) -> list[str]:
        """What ``npuw-kv inspect`` prints of the decisions."""
        kv = self.kv_precision or "the IR's runtime option, else the plugin's default (u8 on CPU)"
        out = [
            "backend          " + ("pa (PagedAttention)" if self.paged else "sdpa (static shapes)"),
            f"compute          {self.compute_precision}",
            f"kv precision     {kv}",
        ]
        if self.paged:
            return out
        out.append(
            "models           "
            + ("static per phase" if self.static_models else "one dynamic model, both shapes")
        )
        if self.static_models:
            out += [
                f"ladders          prefill {self.prefill_ladder}, generate {self.generate_ladder}",
                "V layout         "
                + ("[1,H,D,S] (transposed)" if self.v_transposed else "[1,H,S,D]"),
            ]
        if self.npuw_devices:
            f16 = "f16" if self.npuw_f16 else "f32"
            snippets = "; CPU snippets off: bf16 attention on f32 inputs" * self.cpu_snippets_off
            out.append(f"NPUW devices     {self.npuw_devices} ({f16} between sub-graphs{snippets})")
        out.append(f"window KV        {'rings' if self.window_rings else 'whole past'}")
        if self.packed_slots:
            sizes = ", ".join(map(str, self.packed_slots))
            out.append(f"packed generate  {sizes} sequences at once")
        return out


def decide(core: ov.Core, config: C, wide_activations: bool = False) -> Decided[C]:
    """Every ``auto`` of ``config`` decided for ``core``'s devices; ``wide_activations``: the
    model's activations leave the f16 range (:func:`~npuw_kv.model.families.wide_activations`)."""
    is_paged = paged(config)
    devices = npuw_devices(core, config)
    computing = config  # with the f32 hint that keeps a one-CPU process alive, if needed
    if one_cpu_bf16(core, config, devices):
        warnings.warn(
            "this process may run on one CPU only, where OpenVINO's CPU plugin can crash "
            "(SIGFPE) compiling LLM graphs in bf16 (openvinotoolkit/openvino#33300): computing "
            "in f32; set INFERENCE_PRECISION_HINT to choose, or allow more CPUs",
            RuntimeWarning,
            stacklevel=2,
        )
        hint = {**config.compile_properties, "INFERENCE_PRECISION_HINT": "f32"}
        computing = replace(config, compile_properties=hint)  # type: ignore[type-var]
    compute = compute_precision(core, computing)
    stored = (
        paged_kv_precision(config)
        if is_paged
        else kv_precision(core, config, wide_activations, compute)
    )
    f16_between = npuw_f16_tensors(config, wide_activations, stored)
    return Decided(
        computing,
        is_paged,
        static_models(config),
        devices,
        f16_between,
        cpu_snippets_off(core, computing, devices, f16_between),
        compute,
        stored,
        v_transposed(config, devices),
        window_rings(config),
        prefill_ladder(config),
        generate_ladder(config),
        packed_slots=packed_slots(config),
    )
