"""Packed generate models: one token from each of K sequences in one batch-1 call.

An NPU compiles batch 1 only, and a decode step reads every weight once whatever its row count,
so K sequences stepping together cost little more than one.  The K new tokens go along the
token axis of ``input_ids`` / ``position_ids`` (``[1, K]``: each row its own position).  Their KV
does not: each sequence owns a *region* of the per-layer buffer along the heads axis, a past of
``[1, K * H, R, D]`` where heads ``[k H, (k + 1) H)`` are sequence k's ``[1, H, R, D]``, so the K
regions are one dense tensor and each row's attention reads only its own R slots.  (Packing the
sequences along the slot axis under a block-diagonal mask, as cascadia does, reads every other
sequence's slots too, masked: K times the attention work of a batch.)

The rewrite, per attention: the row's new K/V ``[1, H, K, D]`` joins its own region as
``[1, K * H, 1, D]``, the query rows ``[1, A, r K, D]`` (``r`` query heads of a GQA group folded
into rows) become ``[1, K * A, r, D]``, and the mask is an input, ``packed_mask`` (full layers) or
``packed_mask.{W}`` (a window of W), ``[1, K, 1, S]`` with S the layer's past slots plus the row's
own token; the host writes which slots each row reads.  The present outputs stay
``[1, H, K, D]``: dense (an NPU refuses strided outputs), scattered by the host into each
sequence's slot.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from ..errors import ModelLayoutError
from .layout import KVLayout
from .split import EMBEDS_INPUT
from .transforms import tail_input
from .window import attention_layer

PACKED_MASK = "packed_mask"


def packed_mask_input(window: int | None) -> str:
    """The mask input of the attentions of ``window`` (None: full attention)."""
    return PACKED_MASK if window is None else f"{PACKED_MASK}.{window}"


def _const(values: list[int]) -> ov.Output:
    return ops.constant(np.array(values, np.int64)).output(0)


def _param(model: ov.Model, name: str) -> ov.Node | None:
    return next(
        (
            p
            for p in model.get_parameters()
            if p.get_friendly_name() == name or name in p.output(0).get_names()
        ),
        None,
    )


def _past_concat(param: ov.Node) -> ov.Node:
    """The Concat that appends the new tokens' KV to ``param``'s past (through Converts)."""
    out = param.output(0)
    while True:
        targets = list(out.get_target_inputs())
        concat = next(
            (t.get_node() for t in targets if t.get_node().get_type_name() == "Concat"), None
        )
        if concat is not None:
            return concat
        converts = [t.get_node() for t in targets if t.get_node().get_type_name() == "Convert"]
        if len(converts) != 1:
            raise ModelLayoutError(
                f"past input {param.get_friendly_name()!r} does not reach a Concat; not packed"
            )
        out = converts[0].output(0)


def _past_params(model: ov.Model, name: str) -> list[ov.Node]:
    """Past input ``name`` and its tails (a past split in blocks: ``transforms.split_past``)."""
    found, part = [], 0
    while (param := _param(model, tail_input(name, part))) is not None:
        found.append(param)
        part += 1
    return found


def _refresh(node: ov.Node, done: set[str]) -> None:
    """Infer the shapes of ``node`` and its ancestors again, inputs first (the attentions
    before it are packed already, so none of them is an unpacked one)."""
    stack: list[tuple[ov.Node, bool]] = [(node, False)]
    while stack:
        current, ready = stack.pop()
        name = current.get_name()
        if name in done:
            continue
        if ready or current.get_type_name() in ("Constant", "Parameter"):
            current.validate_and_infer_types()
            done.add(name)
            continue
        stack.append((current, True))
        stack.extend((i.get_source_output().get_node(), False) for i in current.inputs())


def _concat_of(value: ov.Output, concats: set[str]) -> bool:
    """Whether ``value`` is one of ``concats`` (by node name), through Converts only."""
    node = value.get_node()
    while node.get_type_name() == "Convert":
        node = node.input_value(0).get_node()
    return node.get_name() in concats


def pack_slots(model: ov.Model, layout: KVLayout, slots: int) -> int:
    """Rewrite ``model`` (prepared, before its static reshape; its past may be split in blocks)
    to step ``slots`` sequences at once (module docstring).  Returns the attentions rewritten.

    Refused (:class:`ModelLayoutError`, said by the caller with the setting): V transposed, an
    attention whose K/V reach it other than straight from the joined past (a GQA expansion kept
    for attention sinks), or one this rewrite cannot tie to a layer."""
    if any(p.seq_axis != 2 for p in layout.ports):
        raise ModelLayoutError("a packed model reads V as [1, H, S, D], not transposed")
    concats: set[str] = set()
    for port in layout.ports:
        h, d = port.num_heads, port.head_dim
        for param in _past_params(model, port.input_name):
            rows = param.get_partial_shape()[2]
            param.set_partial_shape(ov.PartialShape([1, slots * h, rows, d]))
            param.validate_and_infer_types()
        param = _param(model, port.input_name)
        assert param is not None
        concat = _past_concat(param)
        if concat.get_name() in concats:
            continue
        concats.add(concat.get_name())
        last = concat.get_input_size() - 1
        new = concat.input_value(last)  # [1, H, K, D]: the new tokens' KV
        order = ops.transpose(new, _const([0, 2, 1, 3]))
        rows = ops.reshape(order, _const([1, slots * h, 1, d]), False)
        concat.input(last).replace_source_output(rows.output(0))
    key_layers = {p.input_name: p.layer for p in layout.ports if p.kind == "key"}
    masks: dict[int | None, ov.Output] = {}
    rewritten, refreshed = 0, set[str]()
    for sdpa in model.get_ordered_ops():
        if sdpa.get_type_name() != "ScaledDotProductAttention" or sdpa.get_input_size() < 4:
            continue
        if not all(_concat_of(sdpa.input_value(i), concats) for i in (1, 2)):
            raise ModelLayoutError(
                f"attention {sdpa.get_friendly_name()!r} reads its K/V through more than the "
                "joined past (a GQA expansion kept for attention sinks)"
            )
        layer = attention_layer(sdpa, key_layers)
        if layer is None:
            raise ModelLayoutError(f"attention {sdpa.get_friendly_name()!r} is tied to no layer")
        for i in (1, 2):  # the joined past's new shape, up to this attention
            _refresh(sdpa.input_value(i).get_node(), refreshed)
        _pack_attention(sdpa, slots, layout.window[layer], masks)
        rewritten += 1
    if rewritten != layout.num_layers:
        raise ModelLayoutError(f"{rewritten} attentions packed for {layout.num_layers} layers")
    params = [m.get_node() for m in masks.values() if m.get_node().get_type_name() == "Parameter"]
    model.add_parameters(params)
    mask = _param(model, "attention_mask")
    if mask is not None and not mask.output(0).get_target_inputs():
        model.remove_parameter(mask)
    model.validate_nodes_and_infer_types()
    return rewritten


def _pack_attention(
    sdpa: ov.Node,
    slots: int,
    window: int | None,
    masks: dict[int | None, ov.Output],
) -> None:
    """Give ``sdpa`` its rows per sequence region (module docstring).  The query
    ``[1, A, r K, D]`` has ``g = A / B`` heads for each of the B K/V heads of a slot (1 after
    the GQA fold; A for one K/V head that SDPA broadcasts, multi-query attention): it becomes
    ``[1, K B, g r, D]``, each slot's K/V head with the rows of its query heads."""
    query, key = sdpa.input_value(0), sdpa.input_value(1)
    heads, rows, dim = (query.get_partial_shape()[i].get_length() for i in (1, 2, 3))
    kv_heads = key.get_partial_shape()[1].get_length() // slots
    per_kv, group = heads // kv_heads, rows // slots  # query heads per K/V head; rows per token
    if per_kv * kv_heads != heads:
        raise ModelLayoutError(f"{heads} query heads over {kv_heads} K/V heads")
    q = ops.reshape(query, _const([1, kv_heads, per_kv, group, slots, dim]), False)
    q = ops.transpose(q, _const([0, 4, 1, 2, 3, 5]))
    q = ops.reshape(q, _const([1, slots * kv_heads, per_kv * group, dim]), False)
    kind = sdpa.input_value(3).get_element_type()
    boolean = kind == ov.Type.boolean
    if window not in masks:
        param = ops.parameter([1, slots, 1, -1], ov.Type.boolean if boolean else ov.Type.f16)
        param.set_friendly_name(packed_mask_input(window))
        param.output(0).set_names({packed_mask_input(window)})
        masks[window] = param.output(0)
    source = masks[window]
    if (source.get_element_type() == ov.Type.boolean) != boolean:
        raise ModelLayoutError(f"attentions of window {window} take boolean and additive masks")
    mask = source if source.get_element_type() == kind else ops.convert(source, kind).output(0)
    # each sequence's row of the mask, for every one of its K/V heads: [1, K * B, 1, S]
    keys = ops.gather(ops.shape_of(source, ov.Type.i64), _const([3]), 0)
    spread = ops.concat([_const([1, slots, kv_heads, 1]), keys], 0)
    mask = ops.broadcast(ops.unsqueeze(mask, _const([2])), spread)
    mask = ops.reshape(mask, ops.concat([_const([1, slots * kv_heads, 1]), keys], 0), False)
    extra = [sdpa.input_value(i) for i in range(4, sdpa.get_input_size())]
    attn = ops.scaled_dot_product_attention(q, key, sdpa.input_value(2), mask, *extra, causal=False)
    out = ops.reshape(attn, _const([1, slots, kv_heads, per_kv, group, dim]), False)
    out = ops.transpose(out, _const([0, 2, 3, 4, 1, 5]))
    out = ops.reshape(out, _const([1, heads, rows, dim]), False)
    sdpa.output(0).replace(out.output(0))


def every_row_hidden(model: ov.Model, layout: KVLayout) -> bool:
    """Undo ``lm_head_on_last``: the output (hidden state or logits) of every row, one per
    packed sequence.  False when the output was not cut to the last row."""
    result = model.outputs[layout.logits_output_index].get_node()
    node = result.input_value(0).get_node()
    for _ in range(8):  # the Slice sits a few nodes above the output (a Convert, the head)
        if node.get_type_name() == "Slice" or not node.get_input_size():
            break
        node = node.input_value(0).get_node()
    if node.get_type_name() != "Slice":
        return False
    for target in list(node.output(0).get_target_inputs()):
        target.replace_source_output(node.input_value(0))
    model.validate_nodes_and_infer_types()
    return True


def reshape_packed(
    model: ov.Model, layout: KVLayout, slots: int, blocks: tuple[int, ...], past: int
) -> None:
    """Static shapes of a packed model: ``[1, K]`` tokens, each past block ``[1, K H, b, D]``
    (a ring its slots), each mask ``[1, K, 1, S]``."""
    shapes: dict[str, ov.PartialShape] = {"position_ids": ov.PartialShape([1, slots])}
    names = {n for p in model.get_parameters() for n in p.output(0).get_names()}
    if "input_ids" in names:
        shapes["input_ids"] = ov.PartialShape([1, slots])
    embeds = _param(model, EMBEDS_INPUT)
    if embeds is not None:
        hidden = embeds.get_output_partial_shape(0)[-1]
        shapes[EMBEDS_INPUT] = ov.PartialShape([1, slots, hidden])
    for port in layout.ports:
        h, d = slots * port.num_heads, port.head_dim
        ring = layout.ring_of(port.layer)
        if ring is not None:
            shapes[port.input_name] = ov.PartialShape([1, h, ring, d])
            continue
        for part, rows in enumerate(blocks or (past,)):
            shapes[tail_input(port.input_name, part)] = ov.PartialShape([1, h, rows, d])
    rings = dict(layout.rings)
    for window in {None, *layout.window}:
        name = packed_mask_input(window)
        if name in names:
            keys = rings.get(window, past) if window is not None else past
            shapes[name] = ov.PartialShape([1, slots, 1, keys + 1])
    model.reshape(shapes)
