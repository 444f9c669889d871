"""Compile the prepared models for a device and create the infer requests."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import openvino as ov

from ..config.decide import Decided
from ..config.pipeline_config import PipelineConfig
from ..config.settings import MAX_NUM_SEQS, label
from ..errors import CompileError, ModelLayoutError, UsageError, last_line
from ..kv.shapes import StaticShapes
from ..model.dynamic_shapes import refuse_run_time_shapes
from ..model.layout import KVLayout
from ..model.split import SplitModel, split_model
from ..model.value_layout import ValueLayouts
from ..model.variants import Ladder, shared_dynamic, static_ladder
from .device import NpuIO, device_properties, limit_runtime_cache
from .npu_compile import missing_npu
from .npu_strides import StridesChosen


@dataclass(frozen=True)
class Variant:
    """A static model of a smaller past than the largest (pyramid prefill, generate ladder)."""

    past: int
    request: ov.InferRequest


@dataclass(frozen=True)
class PackedVariant:
    """A generate model stepping ``slots`` sequences at once (``model/packed.py``), and the LM
    head for its rows (None: the model keeps its own)."""

    slots: int
    request: ov.InferRequest
    head: ov.InferRequest | None = None


@dataclass(kw_only=True)
class Requests:
    prefill: ov.InferRequest  # the whole prefill past (or the one dynamic model)
    generate: ov.InferRequest  # the whole buffer
    shared_weights: bool  # True when both requests come from one compiled model
    device_properties: dict[str, Any]
    # static models with the embedding and LM head cut out (model/split.py): run around them
    embed: ov.InferRequest | None = None
    head: ov.InferRequest | None = None
    # smaller variants, ascending by past (the largest is ``prefill`` / ``generate``)
    prefill_ladder: tuple[Variant, ...] = ()
    generate_ladder: tuple[Variant, ...] = ()
    # each phase's KV layout when it is not the prepared model's (V transposed)
    prefill_layout: KVLayout | None = None
    generate_layout: KVLayout | None = None
    # the NPU path: how its requests meet an NPU's I/O rules (None off it), and the devices
    # NPUW was allowed to place the static models' sub-models on (runtime/npu_compile.py)
    npu_io: NpuIO | None = None
    npuw_placement: str = ""
    # packed generate models (model/packed.py), ascending by the sequences they step at once
    packed: tuple[PackedVariant, ...] = ()
    # the runner whose KV views the requests hold now (several share them: packed slots)
    bound_to: object = None

    def logits_output(self, index: int) -> ov.Output:
        """The compiled output that holds the logits (the head's, when cut out)."""
        if self.head is not None:
            return self.head.get_compiled_model().outputs[0]
        return self.prefill.get_compiled_model().outputs[index]


def _split(model: ov.Model, layout: KVLayout, config: PipelineConfig) -> SplitModel | None:
    """The model cut into embed / body / head (see model/split.py), or None to run it whole:
    when every logit row is wanted, when ``shared_head`` is off, or when the cut does not fit
    the graph (said in a warning unless the head was asked to be shared)."""
    if config.full_prefill_logits or config.shared_head is False:
        return None
    try:
        return split_model(model, layout)
    except ModelLayoutError as exc:
        if config.shared_head:
            raise
        warnings.warn(
            f"cannot cut the embedding and LM head out of this model ({exc}); every static "
            "model keeps its own copy of them",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def _head_target(
    config: PipelineConfig, device: str, props: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    """Where the cut-out LM head compiles, and with what.

    NPUW on the CPU runs it on the CPU plugin as it is (a standalone NPUW compile of the head
    leaves the weights as constants its CPU sub-request quantizes dynamically: |dlogit| 1.5e-2
    under the exact f32 settings, 3e-5 on the CPU plugin).  With an NPU present it goes there,
    unfolded (one MatMul: nothing to fold, and NPUW crashes on it with every sub-graph a
    function and f32 tensors between them).
    """
    if device == "NPU" and props.get("NPUW_DEVICES") != "CPU":
        given = {k: v for k, v in config.compile_properties.items() if k in props}
        return device, {**props, "NPUW_FUNCALL_FOR_ALL": "NO", **given}
    cpu = {k: v for k, v in config.compile_properties.items() if not k.upper().startswith("NPU")}
    if config.num_threads:
        cpu["INFERENCE_NUM_THREADS"] = config.num_threads
    return "CPU", cpu


def compile_requests(
    core: ov.Core,
    model: ov.Model,
    layout: KVLayout,
    decided: Decided[PipelineConfig],
    shapes: StaticShapes,
    unpartitioned: str | None = None,
) -> Requests:
    """The static models of ``shapes`` (or the one dynamic model), compiled.  ``unpartitioned``:
    the model family NPUW must not partition
    (:func:`~npuw_kv.model.families.npuw_unpartitioned`).  Where NPUW cannot fold or partition
    the models, each fallback is one method of :class:`StaticCompile`, said in a warning."""
    config = decided.config
    device, props = device_properties(decided)
    if decided.npuw_devices:  # NPUW compiles its CPU sub-models through this core
        given = config.compile_properties.get("SNIPPETS_MODE")
        if given is not None or decided.cpu_snippets_off:
            core.set_property("CPU", {"SNIPPETS_MODE": given or "DISABLE"})
    if not decided.static_models:
        compiled = core.compile_model(shared_dynamic(model, layout), device, props)
        return Requests(
            prefill=compiled.create_infer_request(),
            generate=compiled.create_infer_request(),
            shared_weights=True,
            device_properties=props,
        )
    split = _split(model, layout, config)
    static = StaticCompile(
        core=core,
        device=device,
        config=config,
        split=split,
        ladder=checked_ladder(split.body if split is not None else model, layout, decided, shapes),
        strides=StridesChosen(decided),
    )
    # NPUW crashes on a whole GGUF-converted model with every sub-graph a function and f32
    # tensors between them; the split body compiles
    if (
        split is None
        and props.get("NPUW_F16IC") == "NO"
        and "NPUW_FUNCALL_FOR_ALL" not in config.compile_properties
    ):
        props = {**props, "NPUW_FUNCALL_FOR_ALL": "NO"}
    if unpartitioned and device == "NPU" and not static.partition_given:
        why = f"NPUW's partitioned execution gives wrong tokens for {unpartitioned} models here"
        return static.whole_models(props, why)
    try:
        return static.compile(props)
    except RuntimeError as exc:
        if props.get("NPUW_FOLD") != "YES" or isinstance(exc, UsageError) or missing_npu(exc):
            raise  # a missing NPU compiler is not a folding failure: no second compile
        return static.after_fold_failed(props, exc)


@dataclass(kw_only=True)
class StaticCompile:
    """The static models of one pipeline compiled on ``device``, folded into NPUW's weights
    bank when it can (:meth:`compile`), else by the fallbacks below."""

    core: ov.Core
    device: str
    config: PipelineConfig
    ladder: Ladder
    split: SplitModel | None  # the embedding and head cut out (None: whole models)
    strides: StridesChosen  # the KV ports' strides npuw-kv chose, dropped if refused

    @property
    def partition_given(self) -> bool:
        return "NPUW_ONLINE_PIPELINE" in self.config.compile_properties

    @property
    def _variants_asked(self) -> tuple[bool, bool]:
        """Unfolded or unpartitioned, every model holds the weights: the variants only where
        asked for explicitly."""
        return self.config.prefill_attention == "pyramid", self.config.generate_pyramid is True

    @property
    def _fewer(self) -> str:
        if all(self._variants_asked):
            return ""
        return (
            "; without the variants not asked for explicitly (prefill_attention='pyramid', "
            "generate_pyramid=YES): one prefill and one generate model"
        )

    def compile(
        self, props: dict[str, Any], pyramid: bool = True, variants: bool = True
    ) -> Requests:
        """Every model of the ladder (or only the largest of each phase) with ``props``."""

        def request(m: ov.Model) -> ov.InferRequest:
            compiled = self.strides.compile(
                lambda p: self.core.compile_model(m, self.device, p), props
            )
            return compiled.create_infer_request()

        ladder, config = self.ladder, self.config
        prefills = ladder.prefill if pyramid else ladder.prefill[-1:]
        generates = ladder.generate if variants else ladder.generate[-1:]
        prefill = [Variant(past, request(m)) for past, m in prefills]
        generate = [Variant(past, request(m)) for past, m in generates]
        packed = [(slots, request(m)) for slots, m in ladder.packed]
        embed = head = None
        heads: dict[int, ov.InferRequest] = {}
        if self.split is not None:
            # the gather runs on the host, as NPUW's own (NPUW_HOST_GATHER): exact f32 rows
            host: dict[str, Any] = {"INFERENCE_PRECISION_HINT": "f32"}
            if config.num_threads:
                host["INFERENCE_NUM_THREADS"] = config.num_threads
            embed = self.core.compile_model(self.split.embed, "CPU", host).create_infer_request()
            head, heads = self._heads(props, [slots for slots, _ in packed])
        return Requests(
            prefill=prefill[-1].request,
            generate=generate[-1].request,
            shared_weights=False,
            device_properties=props,
            embed=embed,
            head=head,
            prefill_ladder=tuple(prefill[:-1]),
            generate_ladder=tuple(generate[:-1]),
            prefill_layout=ladder.prefill_layout,
            generate_layout=ladder.generate_layout,
            packed=tuple(PackedVariant(n, r, heads.get(n)) for n, r in packed),
        )

    def _heads(
        self, props: dict[str, Any], packed: list[int]
    ) -> tuple[ov.InferRequest, dict[int, ov.InferRequest]]:
        """The cut-out LM head for one row, and for each packed model's rows.  On the CPU one
        head of any row count serves all (one copy of its weights); elsewhere (an NPU) each
        row count compiles its own."""
        assert self.split is not None
        device, head_props = _head_target(self.config, self.device, props)
        head, hidden = self.split.head, self.split.hidden_size
        if device == "CPU" and packed:
            head = head.clone()
            head.reshape({0: ov.PartialShape([1, -1, hidden])})
            one = self.core.compile_model(head, device, head_props).create_infer_request()
            return one, dict.fromkeys(packed, one)
        one = self.core.compile_model(head, device, head_props).create_infer_request()
        heads = {}
        for rows in packed:
            sized = head.clone()
            sized.reshape({0: ov.PartialShape([1, rows, hidden])})
            heads[rows] = self.core.compile_model(sized, device, head_props).create_infer_request()
        return one, heads

    def whole_models(self, props: dict[str, Any], why: str) -> Requests:
        """Each static model one sub-graph, holding its own weights (said in a warning)."""
        warnings.warn(
            f"{why}: compiling with NPUW_ONLINE_PIPELINE=NONE and NPUW_FOLD=NO, so every "
            f"static model is one sub-graph holding its own copy of the weights{self._fewer}",
            RuntimeWarning,
            stacklevel=4,
        )
        return self.compile({**props, **UNPARTITIONED}, *self._variants_asked)

    def after_fold_failed(self, props: dict[str, Any], exc: RuntimeError) -> Requests:
        """NPUW could not compile the folded models: an explicit ``NPUW_FOLD`` is refused by
        name; a partitioning failure runs whole models; else the models run unfolded."""
        reason = last_line(exc)
        if "NPUW_FOLD" in self.config.compile_properties:
            raise RuntimeError(
                f"NPU compile failed with NPUW_FOLD=YES, set explicitly ({reason}); leave "
                "NPUW_FOLD unset to fall back to NPUW_FOLD=NO when folding fails"
            ) from exc
        if _partitioning_failed(exc) and not self.partition_given:
            # NPUW's online partitioner left a sub-graph referring to another's parameter
            # (seen on small models, e.g. 2 layers of width 64)
            return self.whole_models(props, f"NPUW could not partition this model ({reason})")
        return self.unfolded(props, reason)

    def unfolded(self, props: dict[str, Any], reason: str) -> Requests:
        """Every static model with its own copy of the weights (``NPUW_FOLD=NO``): e.g.
        optimum-intel's fp16 SmolLM2 export with ``NPUW_FUNCALL_FOR_ALL=NO``, whose folding
        fails ("unordered_map::at")."""
        warnings.warn(
            f"NPUW could not fold this model ({reason}); compiling with NPUW_FOLD=NO, so "
            f"every static model holds its own copy of the weights{self._fewer}",
            RuntimeWarning,
            stacklevel=4,
        )
        try:
            return self.compile({**props, "NPUW_FOLD": "NO"}, *self._variants_asked)
        except RuntimeError as again:
            # unfolded, the partitioner can still fail (GPT-2: the embedding not cut out)
            if not _partitioning_failed(again) or self.partition_given:
                raise
            return self.whole_models(
                props, f"NPUW could not partition this model ({last_line(again)})"
            )


# NPUW runs each static model as one sub-graph (so nothing to fold into a weights bank)
UNPARTITIONED = {"NPUW_ONLINE_PIPELINE": "NONE", "NPUW_FOLD": "NO"}


def _partitioning_failed(exc: BaseException) -> bool:
    """NPUW's partitioner produced an invalid sub-graph (not a setting's fault)."""
    return "references undeclared parameters" in str(exc)


def checked_ladder(
    model: ov.Model, layout: KVLayout, decided: Decided[PipelineConfig], shapes: StaticShapes
) -> Ladder:
    """The static models of ``shapes``, V transposed in both phases or none, after what the
    model could not take was refused (a setting asked for) or left for the plain path with a
    warning (``auto``)."""
    values = ValueLayouts(decided.v_transposed, decided.v_transposed)
    packed = decided.packed_slots
    ladder = static_ladder(model, layout, shapes, values, packed)
    if check_value_layouts(decided.config, ladder):
        ladder = static_ladder(model, layout, shapes, packed=packed)  # V [1, H, S, D] in both
    check_variants(decided.config, ladder)
    if decided.config.device == "NPU":
        for _, static_model in (*ladder.prefill[-1:], *ladder.generate[-1:]):
            refuse_run_time_shapes(static_model, "NPU")
    return ladder


def check_value_layouts(config: PipelineConfig, ladder: Ladder) -> bool:
    """Where the V rewrite does not match a phase's graph, that phase keeps V as
    ``[1, H, S, D]`` (NPUW does the same per model) and the runner re-lays the prompt's V out at
    the switch.  Asked for explicitly, that is said in a warning, and refused when no phase
    matches.  Under ``auto`` V stays untransposed in both phases, with a warning: True when the
    ladder must be built again for that (one phase had matched)."""
    if not ladder.mismatched:
        return False
    reasons = "; ".join(f"{phase}: {why}" for phase, why in ladder.mismatched.items())
    if config.optimize_v_tensors is None:
        warnings.warn(
            f"{label('optimize_v_tensors')} auto (V transposed where NPUW runs on an NPU): this "
            f"model's attention does not match the V-transpose rewrite ({reasons}); V stays "
            "[1, H, S, D] in every static model. Set it NO to silence this",
            RuntimeWarning,
            stacklevel=5,
        )
        return len(ladder.mismatched) < 2
    if len(ladder.mismatched) == 2:
        raise ModelLayoutError(
            f"{label('optimize_v_tensors')} YES: this model's attention does not match the "
            f"V-transpose rewrite ({reasons}); set it NO or leave it unset"
        )
    warnings.warn(
        f"{label('optimize_v_tensors')} YES: the {' and '.join(ladder.mismatched)} models keep "
        f"V as [1, H, S, D] ({reasons}); the prompt's V is re-laid out (copied) at every "
        "prefill -> generate switch",
        RuntimeWarning,
        stacklevel=5,
    )
    return False


def check_variants(config: PipelineConfig, ladder: Ladder) -> None:
    """A phase whose smaller variants did not reshape runs on its whole-past model alone:
    refused where the variants were asked for (``prefill_attention='pyramid'``,
    ``generate_pyramid=YES``), said in a warning where they were ``auto``."""
    settings = {
        "prefill": ("prefill_attention", config.prefill_attention == "pyramid", "'static'"),
        "generate": ("generate_pyramid", config.generate_pyramid is True, "NO"),
    }
    for phase, why in ladder.dropped.items():
        if phase == "packed":  # max_num_seqs' default: one sequence at a time, said
            name = label("max_num_seqs")
            if config.max_num_seqs != MAX_NUM_SEQS:
                raise ModelLayoutError(f"{name} {config.max_num_seqs}: {why}; set it 1")
            warnings.warn(
                f"{name} {MAX_NUM_SEQS} (the default): {why}; this model runs one sequence "
                "at a time on this path. Set it 1 to silence this",
                RuntimeWarning,
                stacklevel=5,
            )
            continue
        name, explicit, plain = settings[phase]
        if explicit:
            raise ModelLayoutError(
                f"{label(name)}: {why}; set it {plain} (one {phase} model over the whole past)"
            )
        warnings.warn(
            f"{label(name)} auto: {why}; the {phase} runs on one model over the whole past. "
            f"Set it {plain} to silence this",
            RuntimeWarning,
            stacklevel=5,
        )


def compile_paged(
    core: ov.Core, model: ov.Model, decided: Decided[PipelineConfig]
) -> ov.InferRequest:
    """Compile a PagedAttention model (CPU) with its KV precision and small per-shape caches.

    The plugin's paged kernel stores KV as u8 or in the compute precision (f16 too under f32
    compute); another pairing is refused here, naming the settings, rather than by the plugin.
    """
    device, props = device_properties(decided)
    props = limit_runtime_cache(props)
    precision = decided.kv_precision
    if precision not in (None, "u8"):
        compute = decided.compute_precision
        allowed = {"u8", compute} | ({"f16"} if compute == "f32" else set())
        if precision not in allowed:
            f32 = "INFERENCE_PRECISION_HINT=f32 to store it, or " * (precision in ("f16", "f32"))
            raise CompileError(
                f"kv_precision (KV_CACHE_PRECISION) {precision!r} cannot go with {compute} "
                f"compute (INFERENCE_PRECISION_HINT) on attention_backend (ATTENTION_BACKEND) "
                f"'pa', which stores KV as one of {sorted(allowed)}; set {f32}"
                "attention_backend='sdpa' for any KV precision"
            )
    # auto (None) passes nothing: the plugin then takes the IR's runtime option (optimum-intel
    # writes KV_CACHE_PRECISION=f16 into its exports) or its own default (u8 on CPU), as it does
    # for genai's pipeline on the same IR; a precision given is named, and wins over the IR's
    if precision is not None:
        props = {**props, "KV_CACHE_PRECISION": precision}
    return core.compile_model(model, device, props).create_infer_request()
