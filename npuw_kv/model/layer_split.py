"""Cut the static prefill body at its attention ops: per-layer segments and attention alone.

A pyramid of whole static models pays for every past length with a whole model's buffers
(~40 MB each at 4k on SmolLM2), so only a few fit.  Only attention depends on the past length,
though: everything between two attention ops (the output projection, the MLP, the next
layer's norm, Q/K/V projections and RoPE) sees ``C`` tokens whatever the past.  So the
prefill runs as a chain: segment 0 (embeddings -> layer 0's Q, K, V), then for each layer its
attention over exactly the past the chunk needs, then the next segment.  The middle segments
are one graph with the layer's weights as inputs (compiled once, like NPUW's function
folding); the attention is one weightless graph per past length, shared by every layer.

The segments write each layer's new K/V rows (in the cache precision) and attention reads the
buffer ``[0, past + C)``, which then holds both the past and the chunk's own rows.

Not wired into the pipeline: on NPUW over the CPU plugin the chain only ties NPUW's own pyramid
mode at 4k, its 61 calls per chunk costing about what the exact pasts save; as a generate chain
it decodes slower, and it holds more memory than whole-model variants (docs/measurements.md,
"Attention cut out of the layers").
``scripts/attention_split_probe.py`` runs and measures it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from ..errors import ModelLayoutError
from .layout import KVLayout
from .split import HIDDEN_OUTPUT, parameter_free

SDPA = "ScaledDotProductAttention"


@dataclass
class Segment:
    """One piece of the chain: ``model``'s inputs are its boundary inputs (``LayerSplit.wiring``)
    and then, for the middle one, the weights; ``weights[layer]`` the tensors bound there."""

    model: ov.Model
    weights: dict[int, list[ov.Tensor]] = field(default_factory=dict)
    # the constants ``weights`` view: a view does not keep its constant alive
    owners: list[list[ov.Node]] = field(default_factory=list)


# where a segment input comes from: ("attention", layer), ("input", name) or
# ("segment", k, output index)
Source = tuple


@dataclass
class LayerSplit:
    first: Segment  # embeddings -> layer 0's Q, K, V
    middle: Segment  # layer l-1's attention output -> layer l's Q, K, V (one graph, weights in)
    last: Segment  # the last layer's attention output -> the hidden state
    # segment k's inputs (before the weights), in its graph's order; its outputs are layer k's
    # query, new K, new V (the last segment's: the hidden state), then what later ones read
    wiring: list[list[Source]]
    query_shape: list[int]  # the attention's query [1, Hkv, group * C, D] (GQA folded)
    query_type: ov.Type
    mask_type: ov.Type
    kv_type: ov.Type
    layers: int
    scale: float  # the attention's softmax scale (1 once moved onto the query)

    def attention(self, past: int, chunk: int, kv_heads: int, head_dim: int) -> ov.Model:
        """Attention of one chunk over ``past`` earlier slots: the query, K and V of the slots
        ``[0, past + chunk)`` as the cache stores them, and the mask of those slots (the rows
        of the query tiled per head of a KV group, as the folded query is)."""
        q = ops.parameter(self.query_shape, self.query_type)
        kv = [ops.parameter([1, kv_heads, past + chunk, head_dim], self.kv_type) for _ in "kv"]
        rows = self.query_shape[2]
        mask = ops.parameter([1, 1, rows, past + chunk], self.mask_type)
        k, v = (
            ops.convert(x, self.query_type) if self.kv_type != self.query_type else x for x in kv
        )
        scale = ops.constant(np.array(self.scale, np.float32))
        if self.query_type != ov.Type.f32:
            scale = ops.convert(scale, self.query_type)
        out = ops.scaled_dot_product_attention(q, k, v, mask, scale, causal=False)
        return ov.Model([out], [q, *kv, mask], f"attention_past{past}")


def _name(o: ov.Output) -> str:
    return f"{o.get_node().get_friendly_name()}:{o.get_index()}"


@dataclass
class _Graph:
    """The body's nodes by role: attention regions, each layer's attention, segments."""

    body: ov.Model
    layout: KVLayout
    attention: list[ov.Node] = field(default_factory=list)  # by layer
    after: dict[str, int] = field(default_factory=dict)  # attention op -> the segment it feeds
    segment: dict[str, int] = field(default_factory=dict)  # node name -> segment
    free: dict[str, bool] = field(default_factory=dict)  # parameter-free memo

    def __post_init__(self) -> None:
        body, layout = self.body, self.layout
        if layout.rings or any(w is not None for w in layout.window):
            raise ModelLayoutError("sliding-window layers: attention is not plain causal")
        params = {p.get_friendly_name(): p for p in body.get_parameters()}
        past = {p.input_name: p for p in layout.ports}
        if "attention_mask" not in params or not set(past) <= set(params):
            raise ModelLayoutError("the body has no attention_mask / past KV inputs to cut at")
        region = self._region([params[n] for n in past] + [params["attention_mask"]])
        sdpas = [n for n in body.get_ordered_ops() if n.get_type_name() == SDPA]
        by_layer: dict[int, ov.Node] = {}
        for sdpa in sdpas:
            key = self._past_input(sdpa.input(1).get_source_output().get_node(), region)
            port = past.get(key or "")
            if port is None or port.kind != "key" or port.layer in by_layer:
                raise ModelLayoutError(f"attention {sdpa.get_friendly_name()} reads no past key")
            by_layer[port.layer] = sdpa
        if sorted(by_layer) != list(range(layout.num_layers)):
            raise ModelLayoutError("not one attention op per layer")
        self.attention = [by_layer[i] for i in range(len(by_layer))]
        self.after = after = {s.get_friendly_name(): i + 1 for i, s in enumerate(self.attention)}
        for node in body.get_ordered_ops():
            name = node.get_friendly_name()
            if name in region or name in after or node.get_type_name() == "Result":
                continue
            if node.get_type_name() == "Parameter":
                self.segment[name] = 0
                continue
            if parameter_free(node.output(0), self.free):
                continue
            seg = 0
            for i in node.inputs():
                src = i.get_source_output().get_node().get_friendly_name()
                if src in region:
                    raise ModelLayoutError(f"{name} reads the past outside attention")
                seg = max(seg, after.get(src, self.segment.get(src, 0)))
            self.segment[name] = seg

    @staticmethod
    def _region(starts: list[ov.Node]) -> set[str]:
        """Nodes fed by the past or the mask, up to (not including) the attention ops."""
        seen: set[str] = set()
        stack = list(starts)
        while stack:
            node = stack.pop()
            name = node.get_friendly_name()
            if name in seen or node.get_type_name() == SDPA:
                continue
            if node.get_type_name() == "Result":
                raise ModelLayoutError(f"the past reaches output {name} directly")
            seen.add(name)
            for out in node.outputs():
                for target in out.get_target_inputs():
                    if target.get_node().get_type_name() == SDPA and target.get_index() == 0:
                        raise ModelLayoutError("the past or the mask reaches a query")
                    stack.append(target.get_node())
        return seen

    @staticmethod
    def _past_input(node: ov.Node, region: set[str]) -> str | None:
        stack, seen = [node], set()
        while stack:
            n = stack.pop()
            if n.get_friendly_name() in seen or n.get_friendly_name() not in region:
                continue
            seen.add(n.get_friendly_name())
            if n.get_type_name() == "Parameter":
                return n.get_friendly_name()
            stack.extend(i.get_source_output().get_node() for i in n.inputs())
        return None

    def boundary(self, k: int) -> tuple[list[ov.Output], list[ov.Output]]:
        """Segment ``k``'s inputs (outputs of earlier segments, attention or parameters) and
        outputs (query, new K, new V of layer ``k``, then what later segments read), in the
        body's topological order, so that isomorphic segments list them alike."""
        after = self.after
        inputs: dict[str, ov.Output] = {}
        crossing: dict[str, ov.Output] = {}
        for node in self.body.get_ordered_ops():
            seg = self.segment.get(node.get_friendly_name())
            if seg is None or node.get_type_name() == "Parameter":
                continue
            for i in node.inputs():
                src = i.get_source_output()
                name = src.get_node().get_friendly_name()
                if name not in after and parameter_free(src, self.free):
                    continue
                from_seg = after.get(name, self.segment.get(name))
                is_param = src.get_node().get_type_name() == "Parameter"
                if seg == k and (name in after or from_seg != k or is_param):
                    inputs.setdefault(_name(src), src)
                if from_seg == k and seg > k and name not in after and not is_param:
                    crossing.setdefault(_name(src), src)
        outputs: list[ov.Output] = []
        if k < len(self.attention):
            outputs.append(self.attention[k].input(0).get_source_output())
            for port in self.layout.ports:
                if port.layer == k:
                    outputs.append(self.body.outputs[port.output_index].get_node().input_value(0))
        else:
            outputs.append(self._hidden().get_node().input_value(0))
        outputs += [o for n, o in crossing.items() if n not in {_name(x) for x in outputs}]
        return list(inputs.values()), outputs

    def _hidden(self) -> ov.Output:
        for out in self.body.outputs:
            if HIDDEN_OUTPUT in out.get_names():
                return out
        raise ModelLayoutError("the body has no last_hidden_state output")


def _carve(body: ov.Model, inputs: list[ov.Output], outputs: list[ov.Output]) -> ov.Model:
    """The sub-graph from ``inputs`` to ``outputs`` of a clone of ``body``."""
    clone = body.clone()
    nodes = {n.get_friendly_name(): n for n in clone.get_ordered_ops()}

    def find(o: ov.Output) -> ov.Output:
        return nodes[o.get_node().get_friendly_name()].output(o.get_index())

    params = []
    for src in inputs:
        out = find(src)
        if out.get_node().get_type_name() == "Parameter":
            params.append(out.get_node())
            continue
        param = ops.parameter(out.get_partial_shape(), out.get_element_type())
        for target in list(out.get_target_inputs()):
            target.replace_source_output(param.output(0))
        params.append(param)
    results = [ops.result(find(o)) for o in outputs]
    model = ov.Model(results, params, "segment")
    model.validate_nodes_and_infer_types()
    return model


def _signature(model: ov.Model) -> list[tuple[str, str]]:
    return [
        (n.get_type_name(), ",".join(str(o.get_partial_shape()) for o in n.outputs()))
        for n in model.get_ordered_ops()
    ]


def _fold(models: list[ov.Model]) -> tuple[ov.Model, list[list[ov.Tensor]], list[list[ov.Node]]]:
    """One graph for isomorphic ``models``: the constants that differ between them become
    trailing inputs; per model, the tensors to bind there (views of its constants' data)."""
    sig = _signature(models[0])
    if any(_signature(m) != sig for m in models[1:]):
        raise ModelLayoutError("the layers' graphs differ; they cannot share one graph")
    consts = [[n for n in m.get_ordered_ops() if n.get_type_name() == "Constant"] for m in models]
    varying = [
        i
        for i, c in enumerate(consts[0])
        if any(not np.array_equal(c.get_data(), other[i].get_data()) for other in consts[1:])
    ]
    base = models[0]
    new_params = []
    for i in varying:
        c = consts[0][i]
        param = ops.parameter(c.get_output_partial_shape(0), c.get_output_element_type(0))
        for target in list(c.output(0).get_target_inputs()):
            target.replace_source_output(param.output(0))
        new_params.append(param)
    base.add_parameters(new_params)
    base.validate_nodes_and_infer_types()
    owners = [[m[i] for i in varying] for m in consts]
    return base, [[c.get_tensor_view() for c in layer] for layer in owners], owners


def _static_shapes_as_constants(model: ov.Model) -> None:
    """Replace every ShapeOf of a static shape by its value, so shape arithmetic is constant
    and lives in each segment that needs it instead of crossing segments as a tensor."""
    for node in model.get_ordered_ops():
        if node.get_type_name() != "ShapeOf":
            continue
        shape = node.input(0).get_partial_shape()
        if shape.is_static:
            dtype = node.get_output_element_type(0).to_dtype()
            value = ops.constant(np.array([d.get_length() for d in shape], dtype))
            node.output(0).replace(value.output(0))
    model.validate_nodes_and_infer_types()


def split_layers(body: ov.Model, layout: KVLayout) -> LayerSplit:
    """Cut ``body`` (a static prefill body, model/split.py) into the chain described above.

    Raises :class:`ModelLayoutError` when the graph is not a stack of identical layers whose
    only use of the past and the mask is their attention op."""
    body = body.clone()
    for node in body.get_ordered_ops():  # the segments find their nodes by name in clones
        if node.get_type_name() != "Parameter":  # inputs keep theirs: the wiring names them
            node.set_friendly_name(node.get_name())
    _static_shapes_as_constants(body)
    graph = _Graph(body, layout)
    n = len(graph.attention)
    if n < 3:
        raise ModelLayoutError("fewer than 3 layers: nothing to fold")
    bounds = [graph.boundary(k) for k in range(n + 1)]
    produced = {_name(o): (k, j) for k, (_, outs) in enumerate(bounds) for j, o in enumerate(outs)}
    layer_of = {a.get_friendly_name(): i for i, a in enumerate(graph.attention)}
    wiring: list[list[Source]] = []
    for inputs, _ in bounds:
        sources: list[Source] = []
        for src in inputs:
            node = src.get_node()
            if node.get_friendly_name() in layer_of:
                sources.append(("attention", layer_of[node.get_friendly_name()]))
            elif node.get_type_name() == "Parameter":
                sources.append(("input", node.get_friendly_name()))
            else:
                sources.append(("segment", *produced[_name(src)]))
        wiring.append(sources)
    segments = [_carve(body, *b) for b in bounds]
    middle, weights, owners = _fold(segments[1:n])
    sdpa = graph.attention[0]
    if sdpa.get_input_size() != 5 or sdpa.get_attributes().get("causal"):
        raise ModelLayoutError("attention without an explicit mask and scale")
    scale = sdpa.input(4).get_source_output().get_node()
    while scale.get_type_name() == "Convert":
        scale = scale.input(0).get_source_output().get_node()
    if scale.get_type_name() != "Constant" or scale.get_data().size != 1:
        raise ModelLayoutError("the attention scale is not a constant")
    query = sdpa.input(0).get_source_output()
    return LayerSplit(
        Segment(segments[0]),
        Segment(middle, {k + 1: w for k, w in enumerate(weights)}, owners),
        Segment(segments[n]),
        wiring,
        [d.get_length() for d in query.get_partial_shape()],
        query.get_element_type(),
        sdpa.input(3).get_source_output().get_element_type(),
        body.input(layout.ports[0].input_name).get_element_type(),
        n,
        float(scale.get_data().reshape(-1)[0]),
    )
