"""Put LoRA adapters into the graph beside the weights they adapt, switched by alpha alone.

Every adapted ``MatMul`` (``y = x @ W``) gets ``y + ((x @ A^T) * alpha_r) @ B^T``, with the
adapters' ``A`` matrices of that layer stacked along the rank (``A``: R x in, ``B``: out x R,
R the sum of their ranks) as constants.  One model input, ``npuw_kv_lora_alpha`` (one float per
registered adapter), is gathered into ``alpha_r``, each rank row's adapter's alpha.  So the
shapes are static (what NPUW compiles), the matrices live once beside the weights, and
switching adapters, changing an alpha or running the base model (every alpha 0, which adds an
exact 0) is writing that one input: nothing recompiles.

A layer is found as openvino-genai finds it: the adapter's layer name (PEFT's
``base_model.model.`` prefix dropped) inside the ``MatMul``'s name, with dots or underscores,
as an optimum-intel export names its nodes.  A layer that matches nothing, matches twice or
whose shapes differ from the weight's is refused, naming the adapter and the layer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from ..errors import UsageError
from .head import head_matmul
from .split import parameter_free

ALPHA_INPUT = "npuw_kv_lora_alpha"


@dataclass(frozen=True)
class LoraPair:
    """One layer's low-rank update ``B @ A``."""

    a: np.ndarray  # [rank, in]
    b: np.ndarray  # [out, rank]

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


class Adapter(Protocol):
    """What the rewrite reads of an adapter (``npuw_kv.api.adapters.Adapter``)."""

    @property
    def name(self) -> str: ...

    @property
    def layers(self) -> Mapping[str, LoraPair]: ...


@dataclass(frozen=True)
class LoraGraph:
    """What :func:`apply_lora` did: the adapters in the order of the alpha input's entries."""

    adapters: tuple[Adapter, ...]


def apply_lora(model: ov.Model, adapters: Sequence[Adapter]) -> LoraGraph:
    """Add ``adapters`` to ``model`` (in place) as the module docstring says."""
    targets = weight_matmuls(model)
    aliases = structural_names(model, targets)  # a graph without layer names (GGUF)
    head = _head(model)
    alpha = ops.parameter([len(adapters)], np.float32, name=ALPHA_INPUT)
    alpha.output(0).set_names({ALPHA_INPUT})
    by_node: dict[str, tuple[ov.Node, list[tuple[int, str, LoraPair]]]] = {}
    for index, adapter in enumerate(adapters):
        for layer, pair in adapter.layers.items():
            found = [
                n
                for n in targets
                if _named(n.get_friendly_name(), layer) or aliases.get(n.get_name()) == layer
            ]
            if len(found) != 1:
                why = (
                    "no MatMul of the model is named after it"
                    if not found
                    else f"{len(found)} MatMuls are named after it"
                )
                raise UsageError(f"LoRA adapter {adapter.name!r}, layer {layer!r}: {why}")
            node = found[0]
            if head is not None and node.get_name() == head.get_name():
                raise UsageError(
                    f"LoRA adapter {adapter.name!r}, layer {layer!r}: the LM head cannot be "
                    "adapted (npuw-kv cuts it to the last token's row)"
                )
            _check_shapes(adapter, layer, node, pair)
            by_node.setdefault(node.get_name(), (node, []))[1].append((index, layer, pair))
    # projections of one input (q/k/v, gate/up) share their down-projection: one MatMul
    groups: dict[tuple[str, int], list[tuple[ov.Node, list[tuple[int, str, LoraPair]]]]] = {}
    for node, parts in by_node.values():
        source = node.input_value(0)
        groups.setdefault((source.get_node().get_name(), source.get_index()), []).append(
            (node, parts)
        )
    for group in groups.values():
        _adapt(group, alpha, len(adapters) == 1)
    model.add_parameters([alpha])
    return LoraGraph(tuple(adapters))


def _named(friendly: str, layer: str) -> bool:
    """The layer's name in the node's, ending at a name boundary (``layers.1.`` must not
    match ``layers.11.``), with dots or with underscores."""
    for name in (friendly, friendly.replace(".", "_")):
        for candidate in (layer, layer.replace(".", "_")):
            if re.search(rf"(?:^|[./_]){re.escape(candidate)}(?:$|[./])", name):
                return True
    return False


def structural_names(model: ov.Model, weights: Sequence[ov.Node]) -> dict[str, str]:
    """Hugging Face layer names for the weight MatMuls of a graph that has none (a
    GGUF-converted IR): ``{node name: "model.layers.N.self_attn.q_proj", ...}``.

    Found by position around each attention op (layer N the N-th): q, k and v are the nearest
    weights upstream of its inputs, o_proj the nearest downstream of it, gate and up the
    nearest after o_proj (gate the one feeding an activation), down_proj the nearest after
    gate.  Empty when the graph names its layers (optimum-intel)."""
    if any("layers." in n.get_friendly_name() for n in weights):
        return {}
    ids = {n.get_name() for n in weights}
    attention = [n for n in model.get_ordered_ops() if n.get_type_name() in _ATTENTION]
    out: dict[str, str] = {}
    for layer, node in enumerate(attention):
        prefix = f"model.layers.{layer}."
        for port, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            _name(
                out, _nearest([node.input_value(port)], ids, up=True), prefix + "self_attn." + proj
            )
        o_proj = _name(out, _nearest([node.output(0)], ids, up=False), prefix + "self_attn.o_proj")
        if o_proj is None:
            continue
        mlp = _nearest([o_proj.output(0)], ids, up=False)
        gates = [n for n in mlp if _feeds_activation(n)]
        ups = [n for n in mlp if not _feeds_activation(n)]
        if len(mlp) == 2 and len(gates) == 1:
            _name(out, gates, prefix + "mlp.gate_proj")
            _name(out, ups, prefix + "mlp.up_proj")
            _name(out, _nearest([gates[0].output(0)], ids, up=False), prefix + "mlp.down_proj")
    return out


_ATTENTION = ("ScaledDotProductAttention", "PagedAttentionExtension")
_ACTIVATIONS = ("Swish", "Sigmoid", "Gelu", "HSwish", "Relu", "Mish", "SoftPlus")


def _name(out: dict[str, str], found: list[ov.Node], name: str) -> ov.Node | None:
    if len(found) != 1:
        return None
    out[found[0].get_name()] = name
    return found[0]


def _feeds_activation(node: ov.Node) -> bool:
    return any(
        i.get_node().get_type_name() in _ACTIVATIONS for i in node.output(0).get_target_inputs()
    )


def _nearest(
    starts: list[ov.Output], weights: set[str], up: bool, depth: int = 40
) -> list[ov.Node]:
    """The weight MatMuls (``weights``: node names) first met walking the graph from
    ``starts``, breadth first, up (toward the inputs) or down; all of the first level that
    meets any."""
    frontier = (
        [o.get_node() for o in starts]
        if up
        else [i.get_node() for o in starts for i in o.get_target_inputs()]
    )
    seen: set[str] = set()
    for _ in range(depth):
        found, nxt = [], []
        for node in frontier:
            if node.get_name() in seen:
                continue
            seen.add(node.get_name())
            if node.get_name() in weights:
                found.append(node)
                continue
            if up:
                nxt += [v.get_node() for v in node.input_values()]
            else:
                nxt += [i.get_node() for out in node.outputs() for i in out.get_target_inputs()]
        if found:
            return found
        frontier = nxt
        if not frontier:
            break
    return []


def weight_matmuls(model: ov.Model) -> list[ov.Node]:
    """MatMuls whose second input is a weight (a constant, maybe decompressed)."""
    memo: dict[str, bool] = {}
    return [
        node
        for node in model.get_ordered_ops()
        if node.get_type_name() == "MatMul" and parameter_free(node.input_value(1), memo)
    ]


def _head(model: ov.Model) -> ov.Node | None:
    for result in model.get_results():
        if "logits" in result.input_value(0).get_names():
            try:
                return head_matmul(result)
            except UsageError:
                return None
    return None


def _weight_shape(node: ov.Node) -> tuple[int, int]:
    """(in, out) of the MatMul's weight."""
    shape = node.input_value(1).get_partial_shape()
    if shape.rank.get_length() != 2 or not shape.is_static:
        raise UsageError(f"{node.get_friendly_name()}: the weight is not a 2-D matrix")
    rows, cols = (int(d.get_length()) for d in shape)
    transposed = node.get_attributes().get("transpose_b", False)
    return (cols, rows) if transposed else (rows, cols)


def _check_shapes(adapter: Adapter, layer: str, node: ov.Node, pair: LoraPair) -> None:
    try:
        inputs, outputs = _weight_shape(node)
    except UsageError as exc:
        raise UsageError(f"LoRA adapter {adapter.name!r}, layer {layer!r}: {exc}") from exc
    if pair.a.shape[1] != inputs or pair.b.shape[0] != outputs:
        raise UsageError(
            f"LoRA adapter {adapter.name!r}, layer {layer!r}: lora_A {list(pair.a.shape)} and "
            f"lora_B {list(pair.b.shape)} do not fit the layer's {inputs} inputs and {outputs} "
            "outputs (an adapter for another model?)"
        )


def _adapt(
    group: list[tuple[ov.Node, list[tuple[int, str, LoraPair]]]], alpha: ov.Node, single: bool
) -> None:
    """``y += ((x @ A^T) * alpha_r) @ B^T`` for every MatMul of ``group`` (one input ``x``):
    their ``A`` stacked so that ``x`` is multiplied once, the result split by rank after the
    scale.  ``single``: one adapter registered, so every rank row's alpha is ``alpha[0]``."""
    x = group[0][0].input_value(0)
    kind = x.get_element_type()
    pairs = [[pair for _, _, pair in parts] for _, parts in group]
    a = np.concatenate([pair.a for node_pairs in pairs for pair in node_pairs], axis=0)
    ranks = [sum(pair.rank for pair in node_pairs) for node_pairs in pairs]
    if single:
        scale: ov.Node = alpha
    else:
        owner = [np.full(pair.rank, i, np.int32) for _, parts in group for i, _, pair in parts]
        scale = ops.gather(alpha, ops.constant(np.concatenate(owner)), ops.constant(np.int32(0)))
    if kind != ov.Type.f32:
        scale = ops.convert(scale, kind)
    down = ops.multiply(ops.matmul(x, _constant(a, kind), False, True), scale)
    if len(group) == 1:
        parts_out = [down.output(0)]
    else:
        split = ops.variadic_split(down, ops.constant(np.int32(-1)), ops.constant(np.array(ranks)))
        parts_out = list(split.outputs())
    for (node, _), node_pairs, low in zip(group, pairs, parts_out, strict=True):
        b = np.concatenate([pair.b for pair in node_pairs], axis=1)
        up = ops.matmul(low, _constant(b, kind), False, True)
        y = node.output(0)
        consumers = y.get_target_inputs()
        total = ops.add(y, up)
        for consumer in consumers:
            consumer.replace_source_output(total.output(0))
        total.set_friendly_name(f"{node.get_friendly_name()}/lora")


def _constant(values: np.ndarray, kind: ov.Type) -> ov.Node:
    if kind == ov.Type.f32:
        return ops.constant(np.ascontiguousarray(values, np.float32))
    return ops.convert(ops.constant(np.ascontiguousarray(values, np.float32)), kind)
