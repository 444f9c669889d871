"""V stored transposed, ``[1, heads, head_dim, seq]`` (NPUW's ``NPUW_LLM_OPTIMIZE_V_TENSORS``).

Attention multiplies the softmax ``[.., L, S]`` by V.  Stored as ``[.., S, D]`` V is the MatMul's
B operand as it is; NPUW's ``OptimizeValueTensors`` stores it as ``[.., D, S]`` instead and
multiplies with ``transpose_b``, the form the NPU compiler runs best (both operands then read
along S).  The rewrite here is that one, on our prepared graph:

* the past-V input becomes ``[1, H, D, S]`` and the Concat that appends the new tokens' V runs
  along axis 3, the new V transposed to ``[B, H, D, n]``;
* the present-V output (the new tokens only, see ``redirect_present_to_new_kv``) becomes
  ``[1, H, D, n]``: the runtime writes it into slots along axis 3 of the shared buffer;
* each attention that reads this V is decomposed (``Q·Kᵀ·scale + mask``, softmax) with the
  product by V a ``MatMul(probs, Vᵀ, transpose_b=True)``; a GQA head expansion left in front of
  it (the fold in ``attention.py`` leaves none for group > 1) is applied to the transposed V;
* anything that reads the past V's shape gets it back in the ``[1, H, S, D]`` order.

The graph is matched first and changed only when every V port matches, so a model the rewrite
does not know is left as it was and :class:`ValueLayoutMismatch` says why; the caller then
keeps V untransposed for that model (and says so), or refuses.  It runs on a prepared model
(after ``set_kv_precision`` too: the Converts around the KV are followed, before the Concat or
after it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from ..errors import ModelLayoutError
from .layout import KVLayout, KVPort

TRANSPOSED_SEQ_AXIS = 3
_SWAP = np.array([0, 1, 3, 2], np.int64)  # [.., S, D] <-> [.., D, S]
_SDPA = "ScaledDotProductAttention"


class ValueLayoutMismatch(ModelLayoutError):
    """The graph around a V input is not the pattern the V-transpose rewrite knows."""


@dataclass(frozen=True)
class ValueLayouts:
    """Whether V is stored transposed in the prefill models and in the generate models.

    Both alike is the normal case (0 bytes at the switch).  NPUW transposes only the generate
    models when the prefill pattern does not match; the runner then re-lays the prompt's V out
    at the switch (:func:`npuw_kv.kv.copy.relayout`).
    """

    prefill: bool = False
    generate: bool = False

    @property
    def mixed(self) -> bool:
        return self.prefill != self.generate


@dataclass
class _Match:
    """What the rewrite changes for one V port (found before anything is changed)."""

    port: KVPort
    param: ov.Node
    concat: ov.Node
    shape_ofs: list[ov.Node] = field(default_factory=list)
    attentions: list[ov.Node] = field(default_factory=list)
    # (attention, the GQA chain's Reshape before it) where V is still expanded per query head
    expanded: list[tuple[ov.Node, ov.Node]] = field(default_factory=list)
    upcast: ov.Node | None = None  # the Convert after a Concat in the stored KV type


def _param(model: ov.Model, name: str) -> ov.Node:
    for param in model.get_parameters():
        if name in param.output(0).get_names() | {param.get_friendly_name()}:
            return param
    raise ValueLayoutMismatch(f"no input {name!r}")


def _gqa_chain_end(output: ov.Output) -> ov.Node | None:
    """The Reshape of an ``Unsqueeze -> Broadcast -> Reshape`` head expansion of ``output``."""
    targets = list(output.get_target_inputs())
    if len(targets) != 1 or targets[0].get_node().get_type_name() != "Unsqueeze":
        return None
    node = targets[0].get_node()
    for kind in ("Broadcast", "Reshape"):
        targets = list(node.output(0).get_target_inputs())
        if len(targets) != 1 or targets[0].get_node().get_type_name() != kind:
            return None
        node = targets[0].get_node()
    return node


def _check_attention(sdpa: ov.Node, name: str) -> None:
    if sdpa.get_input_size() < 4:
        raise ValueLayoutMismatch(f"{name}: its attention has no mask input")
    if sdpa.get_attributes().get("causal", False):
        raise ValueLayoutMismatch(f"{name}: its attention is causal by attribute, not by mask")
    if sdpa.input_value(0).get_partial_shape().rank.get_length() != 4:
        raise ValueLayoutMismatch(f"{name}: its attention's query is not 4-D")


def _match(model: ov.Model, port: KVPort) -> _Match:
    name = port.input_name
    param = _param(model, name)
    found: _Match | None = None
    shape_ofs: list[ov.Node] = []
    frontier = [param.output(0)]
    while frontier:  # the past V, through the Convert of a KV precision
        out = frontier.pop()
        for target in out.get_target_inputs():
            node, kind = target.get_node(), target.get_node().get_type_name()
            if kind == "Convert":
                frontier.append(node.output(0))
            elif kind == "ShapeOf":
                shape_ofs.append(node)
            elif kind == "Concat" and target.get_index() == 0 and node.get_input_size() == 2:
                if found is not None or int(node.get_axis()) not in (2, -2):
                    raise ValueLayoutMismatch(f"{name}: not one Concat along the sequence axis")
                found = _Match(port, param, node)
            else:
                raise ValueLayoutMismatch(f"{name}: the past V feeds a {kind}")
    if found is None:
        raise ValueLayoutMismatch(f"{name}: the past V feeds no Concat")
    found.shape_ofs = shape_ofs
    joined = found.concat.output(0)
    targets = list(joined.get_target_inputs())
    if len(targets) == 1 and targets[0].get_node().get_type_name() == "Convert":
        found.upcast = targets[0].get_node()  # joined in the stored type (set_kv_precision)
        joined = found.upcast.output(0)
    for target in joined.get_target_inputs():
        node = target.get_node()
        if node.get_type_name() == _SDPA and target.get_index() == 2:
            _check_attention(node, name)
            found.attentions.append(node)
            continue
        reshape = _gqa_chain_end(joined)
        readers = list(reshape.output(0).get_target_inputs()) if reshape is not None else []
        if reshape is None or not readers:
            raise ValueLayoutMismatch(f"{name}: V reaches a {node.get_type_name()}, not attention")
        for reader in readers:
            attention = reader.get_node()
            if attention.get_type_name() != _SDPA or reader.get_index() != 2:
                raise ValueLayoutMismatch(f"{name}: the expanded V reaches no attention's V")
            _check_attention(attention, name)
            found.expanded.append((attention, reshape))
    if not found.attentions and not found.expanded:
        raise ValueLayoutMismatch(f"{name}: the concatenated V reaches no attention")
    return found


def _swap(output: ov.Output) -> ov.Output:
    return ops.transpose(output, ops.constant(_SWAP)).output(0)


def _expand_heads(value_t: ov.Output, attention: ov.Node) -> ov.Output:
    """``[B, Hkv, D, S]`` repeated per query head: ``[B, Hq, D, S]`` (GQA, not folded)."""
    q_heads = attention.input_value(0).get_partial_shape()[1]
    kv_heads = value_t.get_partial_shape()[1]
    head_dim = value_t.get_partial_shape()[2]
    if not (q_heads.is_static and kv_heads.is_static and head_dim.is_static):
        raise ValueLayoutMismatch("a GQA expansion of V with dynamic head counts")
    group = q_heads.get_length() // kv_heads.get_length()
    if group * kv_heads.get_length() != q_heads.get_length():
        raise ValueLayoutMismatch("a GQA expansion of V that is not a whole number of groups")
    tiled = ops.tile(
        ops.unsqueeze(value_t, ops.constant(np.array([2], np.int64))),
        ops.constant(np.array([1, 1, group, 1, 1], np.int64)),
    )
    target = np.array([0, q_heads.get_length(), head_dim.get_length(), -1], np.int64)
    return ops.reshape(tiled, ops.constant(target), True).output(0)


def _attend(attention: ov.Node, value_t: ov.Output) -> ov.Output:
    """``attention`` (SDPA, mask given) decomposed, with V given as ``[B, H, D, S]``."""
    query, key, mask = (attention.input_value(i) for i in (0, 1, 3))
    dtype = query.get_element_type()
    scores = ops.matmul(query, key, False, True).output(0)
    if attention.get_input_size() > 4:
        scale = attention.input_value(4)
        node = scale.get_node()
        is_one = node.get_type_name() == "Constant" and np.all(node.get_data() == 1)
        if not is_one:
            if scale.get_element_type() != dtype:
                scale = ops.convert(scale, dtype).output(0)
            scores = ops.multiply(scores, scale).output(0)
    else:
        head_dim = query.get_partial_shape()[3]
        if not head_dim.is_static:
            raise ValueLayoutMismatch("an attention with no scale and a dynamic head_dim")
        factor = np.array(1 / np.sqrt(head_dim.get_length()), np.float32)
        scores = ops.multiply(scores, ops.convert(ops.constant(factor), dtype)).output(0)
    if mask.get_element_type() == ov.Type.boolean:  # True: the key takes part
        zero = ops.convert(ops.constant(np.array(0, np.float32)), dtype)
        low = ops.convert(ops.constant(np.array(-np.inf, np.float32)), dtype)
        mask = ops.select(mask, zero, low).output(0)
    elif mask.get_element_type() != dtype:
        mask = ops.convert(mask, dtype).output(0)
    probs = ops.softmax(ops.add(scores, mask), -1)
    return ops.matmul(probs, value_t, False, True).output(0)


def _rewrite(model: ov.Model, match: _Match) -> None:
    param, concat = match.param, match.concat
    shape = param.get_partial_shape()
    param.set_partial_shape(ov.PartialShape([shape[0], shape[1], shape[3], shape[2]]))
    param.validate_and_infer_types()
    for shape_of in match.shape_ofs:  # readers of the shape get it in the [.., S, D] order
        index = ops.constant(_SWAP.astype(np.int32))
        source = shape_of.input_value(0)
        fixed = ops.gather(ops.shape_of(source, shape_of.get_output_element_type(0)), index, 0)
        for target in list(shape_of.output(0).get_target_inputs()):
            target.replace_source_output(fixed.output(0))
    new = concat.input_value(1)
    new_t = _swap(new)
    joined = ops.concat([concat.input_value(0), new_t], TRANSPOSED_SEQ_AXIS)
    joined.set_friendly_name(concat.get_friendly_name())
    result = model.outputs[match.port.output_index].get_node()
    present = result.input_value(0)
    result.input(0).replace_source_output(new_t if present == new else _swap(present))
    values = joined.output(0)
    if match.upcast is not None:
        values = ops.convert(values, match.upcast.get_destination_type()).output(0)
    for attention in match.attentions:
        out = _attend(attention, values)
        attention.output(0).replace(out)
    for attention, _ in match.expanded:
        out = _attend(attention, _expand_heads(values, attention))
        attention.output(0).replace(out)


def transpose_value_tensors(model: ov.Model, layout: KVLayout) -> KVLayout:
    """Store every V of ``model`` as ``[1, H, D, S]`` (module docstring); the new layout.

    Raises :class:`ValueLayoutMismatch`, with the model unchanged, when a V port does not match.
    """
    ports = [p for p in layout.ports if p.kind == "value" and p.seq_axis != TRANSPOSED_SEQ_AXIS]
    if not ports:
        return layout
    matches = [_match(model, port) for port in ports]
    for match in matches:
        _rewrite(model, match)
    model.validate_nodes_and_infer_types()
    return layout.with_values_transposed()


def phase_bases(
    model: ov.Model, layout: KVLayout, values: ValueLayouts
) -> tuple[dict[str, tuple[ov.Model, KVLayout]], dict[str, str]]:
    """Per phase (``prefill``, ``generate``): the model its static variants are cloned from,
    with V transposed where ``values`` asks, and its layout; plus the phases whose pattern did
    not match (kept untransposed), with the reason.  ``model`` itself is not changed."""
    bases: dict[str, tuple[ov.Model, KVLayout]] = {}
    mismatched: dict[str, str] = {}
    for phase, wanted in (("prefill", values.prefill), ("generate", values.generate)):
        bases[phase] = (model, layout)
        if not wanted:
            continue
        base = model.clone()
        base.set_friendly_name(f"npuw_kv_{phase}")
        try:
            bases[phase] = (base, transpose_value_tensors(base, layout))
        except ValueLayoutMismatch as exc:
            mismatched[phase] = str(exc)
    return bases, mismatched
