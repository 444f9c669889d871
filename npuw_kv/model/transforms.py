"""Graph rewrites that turn a stateful LLM IR into the models the static runtime drives.

Each function mutates the ``ov.Model`` it is given and returns a small count of what it changed,
so callers (and tests) can check that a rewrite actually applied.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import openvino as ov
import openvino.opset13 as ops
from openvino._offline_transformations import stateful_to_stateless_transformation

from ..errors import ModelLayoutError
from .head import head_matmul
from .layout import KVLayout, KVPort
from .ring import mask_input
from .split import EMBEDS_INPUT

_REQUIRED_INPUTS = ("input_ids", "attention_mask", "position_ids")


def input_names(model: ov.Model) -> set[str]:
    return {n for inp in model.inputs for n in inp.get_names()}


def make_stateless(model: ov.Model) -> bool:
    """Expose the KV states as ``past_key_values.*`` inputs / ``present.*`` outputs.

    Returns True if a conversion happened (False if the model was already stateless).
    """
    names = input_names(model)
    missing = [n for n in _REQUIRED_INPUTS if n not in names]
    if missing:
        raise ModelLayoutError(
            f"model lacks inputs {missing}; expected a decoder LLM IR "
            "(optimum-intel export or openvino-genai GGUF conversion)"
        )
    if any(n.startswith("past_key_values") for n in names):
        return False
    if not model.get_sinks():
        raise ModelLayoutError(
            "model has neither KV states (ReadValue/Assign) nor past_key_values inputs: "
            "not a decoder LLM with a KV cache"
        )
    stateful_to_stateless_transformation(model)
    return True


def redirect_present_to_new_kv(model: ov.Model, layout: KVLayout) -> int:
    """Make each present output carry only the new tokens' KV (not past + new).

    The runtime writes those rows straight into their slots of the shared buffer, so the
    device never has to produce (or the host copy) the whole past again.
    """
    changed = 0
    for port in layout.ports:
        result = model.outputs[port.output_index].get_node()
        concat = result.input(0).get_source_output().get_node()
        if concat.get_type_name() != "Concat" or concat.get_input_size() != 2:
            raise ModelLayoutError(f"present output of {port.input_name} is not Concat(past, new)")
        result.input(0).replace_source_output(concat.input(1).get_source_output())
        changed += 1
    model.validate_nodes_and_infer_types()
    return changed


def logits_for_last_position(model: ov.Model, layout: KVLayout) -> None:
    """Compute the LM head for the last position only.

    The runtime lays chunks out so the prompt's last token is always the last row of the last
    chunk; a [C, vocab] logits tensor would cost C times the LM-head work for nothing.
    """
    lm_head_on_last(model, model.outputs[layout.logits_output_index].get_node(), axis=1)


def lm_head_on_last(model: ov.Model, logits: ov.Node, axis: int) -> None:
    """Feed the MatMul behind the ``logits`` Result only the last row along ``axis``."""
    head = head_matmul(logits)
    hidden = head.input(0).get_source_output()
    last = ops.slice(
        hidden,
        ops.constant(np.array([-1], np.int64)),
        ops.constant(np.array([np.iinfo(np.int64).max], np.int64)),
        ops.constant(np.array([1], np.int64)),
        ops.constant(np.array([axis], np.int64)),
    )
    head.input(0).replace_source_output(last.output(0))
    model.validate_nodes_and_infer_types()


def set_shapes(
    model: ov.Model,
    layout: KVLayout,
    tokens: int | None,
    mask_len: int | None,
    past_len: int | None,
    blocks: Sequence[int] = (),
) -> None:
    """Reshape to batch 1 with the given token / mask / past lengths (None = dynamic).

    ``blocks``: a model whose past was split (:func:`split_past`) reads that many slots through
    each of its past inputs in turn (the past, then each tail); they sum to ``past_len``."""

    def dim(n: int | None) -> ov.Dimension:
        return ov.Dimension(n) if n is not None else ov.Dimension()

    shapes: dict[str, ov.PartialShape] = {
        "position_ids": ov.PartialShape([1, dim(tokens)]),
        "attention_mask": ov.PartialShape([1, dim(mask_len)]),
    }
    names = {n for p in model.get_parameters() for n in p.output(0).get_names()}
    if "input_ids" in names:
        shapes["input_ids"] = ov.PartialShape([1, dim(tokens)])
    embeds = next(
        (p for p in model.get_parameters() if EMBEDS_INPUT in p.output(0).get_names()), None
    )
    if embeds is not None:  # the embedding cut off (see split.py)
        hidden = embeds.get_output_partial_shape(0)[-1]
        shapes[EMBEDS_INPUT] = ov.PartialShape([1, dim(tokens), hidden])
    for p in layout.ports:
        ring = layout.ring_of(p.layer)  # a ring's length is the same in every model
        if ring is not None:
            shapes[p.input_name] = ov.PartialShape(p.shape(ring))
        elif blocks:
            if sum(blocks) != past_len:
                raise ValueError(f"past blocks {list(blocks)} do not sum to {past_len} slots")
            for part, rows in enumerate(blocks):
                shapes[tail_input(p.input_name, part)] = ov.PartialShape(p.shape(rows))
        else:
            shapes[p.input_name] = ov.PartialShape(p.shape(dim(past_len)))
    for window, ring in layout.rings:
        keys = None if tokens is None else ring + tokens
        shapes[mask_input(window)] = ov.PartialShape([1, 1, dim(tokens), dim(keys)])
    model.reshape(shapes)


def _param(model: ov.Model, name: str) -> ov.Node:
    """The input named ``name`` (friendly or tensor name)."""
    return next(
        p
        for p in model.get_parameters()
        if p.get_friendly_name() == name or name in p.output(0).get_names()
    )


def tail_input(name: str, part: int = 1) -> str:
    """Name of the ``part``-th input of past ``name`` split by :func:`split_past` (0: the past
    itself, 1: the first tail, ...)."""
    return name if part == 0 else f"{name}.tail" if part == 1 else f"{name}.tail{part}"


def linear_ports(layout: KVLayout) -> list[KVPort]:
    """The ports whose past is the whole buffer, in slot order (not a ring: model/ring.py)."""
    return [p for p in layout.ports if layout.ring_of(p.layer) is None]


def split_past(model: ov.Model, layout: KVLayout, parts: int = 2) -> int:
    """Give every past input ``parts - 1`` more parts (``past.tail``, ``past.tail2``, ...), read
    one after the other right after it.

    Two inputs let one dynamic model take its past from either of two bindings of the same
    contiguous buffer: the prefill binds it as ``past`` (sliced to what its mask covers, see
    :func:`slice_past`) and an empty tail; the generate step binds an empty ``past`` and the
    buffer as the tail, read whole with no slice.  A static model whose past spans several
    blocks of the KV buffer (``SharedKVCache.edges``) takes one dense block per part.  The
    tails join the Concat that appends the new KV (one copy per step, as before), and the past
    length the graph reads off ``ShapeOf(past)`` becomes the sum of the parts.  Returns the
    number of past inputs split.
    """
    if parts < 2:
        raise ValueError(f"a split past has at least 2 parts, not {parts}")
    tails, ports = [], linear_ports(layout)
    for port in ports:
        param = _param(model, port.input_name)
        past = param.output(0)
        extras = []
        for part in range(1, parts):
            name = tail_input(port.input_name, part)
            tail = ops.parameter(param.get_partial_shape(), param.get_element_type(), name=name)
            tail.output(0).set_names({name})
            tails.append(tail)
            extras.append(tail.output(0))
        consumers = list(past.get_target_inputs())
        while len(consumers) == 1 and consumers[0].get_node().get_type_name() == "Convert":
            convert = consumers[0].get_node()  # the KV-precision upcast: give the tails one too
            past = convert.output(0)
            kind = convert.get_destination_type()
            extras = [ops.convert(extra, kind).output(0) for extra in extras]
            consumers = list(past.get_target_inputs())
        joined = None
        axis = port.seq_axis  # 3: V stored transposed, [1, H, D, S]
        for consumer in consumers:
            node = consumer.get_node()
            kind = node.get_type_name()
            if (
                kind == "Concat"
                and consumer.get_index() == 0
                and node.get_axis() in (axis, axis - 4)
            ):
                inputs = [node.input_value(i) for i in range(node.get_input_size())]
                merged = ops.concat([inputs[0], *extras, *inputs[1:]], axis)
                merged.set_friendly_name(node.get_friendly_name())
                node.output(0).replace(merged.output(0))
            elif kind == "ShapeOf":
                index_type = node.get_output_element_type(0)
                seq_only = ops.constant(np.eye(4, dtype=np.int64)[axis], index_type)
                total = ops.shape_of(past, index_type).output(0)
                for extra in extras:
                    extra_len = ops.multiply(ops.shape_of(extra, index_type), seq_only)
                    total = ops.add(total, extra_len).output(0)
                node.output(0).replace(total)
            else:
                if joined is None:
                    joined = ops.concat([past, *extras], axis)
                consumer.replace_source_output(joined.output(0))
    model.add_parameters(tails)
    model.validate_nodes_and_infer_types()
    return len(ports)


def slice_past(model: ov.Model, layout: KVLayout) -> int:
    """Read each split past input (:func:`split_past`) only up to the length the mask gives.

    Both parts can then be bound to the whole ``[1, H, slots, D]`` buffer, which is contiguous,
    so the device reads it in place (a prefix of the slots would be a strided view, which the
    CPU plugin stages through a copy).  The prefill binds the buffer as ``past`` and an empty
    tail: with a mask of ``start + C`` a chunk written from slot ``start`` attends over the
    slots before it, not over MAX_PROMPT_LEN.  The generate step binds an empty ``past`` and
    the buffer as the tail, which is not sliced (a slice would copy the whole past every step).
    Everything that read ``past``, its length included, reads the slice.  Returns the number of
    past inputs sliced.
    """
    ports = linear_ports(layout)  # a ring is read whole, by both phases
    if not ports:
        return 0
    try:
        mask, ids = _param(model, "attention_mask"), _param(model, "input_ids")
    except StopIteration:
        raise ModelLayoutError("slice_past needs the attention_mask and input_ids inputs") from None
    i64 = ov.Type.i64

    def seq_len(node: ov.Node, axis: int) -> ov.Output:
        shape = ops.shape_of(node, i64)
        return ops.gather(shape, ops.constant(np.array([axis], np.int64)), 0).output(0)

    # past slots the mask covers beyond the new tokens and the tail; every port's tail is bound
    # alike (all empty, or all whole buffers), so one computation serves all of them
    covered = ops.subtract(seq_len(mask, 1), seq_len(ids, 1))
    tail = _param(model, tail_input(ports[0].input_name))
    stop = ops.maximum(ops.subtract(covered, seq_len(tail, 2)), ops.constant(np.array([0])))
    for port in ports:
        past = _param(model, port.input_name)
        consumers = list(past.output(0).get_target_inputs())
        sliced = ops.slice(
            past,
            ops.constant(np.array([0], np.int64)),
            stop,
            ops.constant(np.array([1], np.int64)),
            ops.constant(np.array([2], np.int64)),
        )
        for consumer in consumers:
            consumer.replace_source_output(sliced.output(0))
    model.validate_nodes_and_infer_types()
    return len(ports)


def set_kv_precision(model: ov.Model, layout: KVLayout, dtype: str) -> int:
    """Store the KV cache as ``dtype`` (e.g. f16) while attention still computes in f32.

    Past inputs take the new type and are converted right after the Parameter; present
    outputs are converted right before the Result.  The new tokens' KV goes through the same
    rounding before attention reads it, so a token attends to the values the cache holds, as
    a stateful plugin cache does; unrounded, a token would see its own chunk more precisely
    than the chunks before it, and the result would depend on the prefill chunk size.  (The
    CPU plugin removes that round trip for f16 when the CPU has no f16 arithmetic, so there
    f16 KV still moves with the chunk size, by ~1e-3.)  Where the past and the new KV meet in
    one Concat, they are joined in the stored type and upcast once after it
    (:func:`_join_stored`).  Returns the number of ports changed.
    """
    target = getattr(ov.Type, dtype)
    changed = 0
    for port in layout.ports:
        param = _param(model, port.input_name)
        compute = param.get_element_type()
        if compute == target:
            continue
        consumers = list(param.output(0).get_target_inputs())
        param.set_element_type(target)
        param.validate_and_infer_types()
        upcast = ops.convert(param.output(0), compute)
        for consumer in consumers:
            consumer.replace_source_output(upcast.output(0))
        result = model.outputs[port.output_index].get_node()
        fresh = result.input(0).get_source_output()
        readers = [i for i in fresh.get_target_inputs() if i.get_node() is not result]
        down = ops.convert(fresh, target)
        result.input(0).replace_source_output(down.output(0))
        rounded = ops.convert(down.output(0), compute)
        for reader in readers:
            reader.replace_source_output(rounded.output(0))
        _join_stored(param, upcast, rounded)
        changed += 1
    model.validate_nodes_and_infer_types()
    return changed


def _join_stored(param: ov.Node, upcast: ov.Node, rounded: ov.Node) -> None:
    """Concat the stored past and the stored new KV, then upcast the joined tensor once.

    Upcasting the past before the Concat gives every compiled model a buffer of the whole past in
    the compute type besides the Concat's own, per static model (docs/measurements.md, "f16 KV
    joined before the upcast").  The values are the same (f16 and bf16 widen to f32 exactly).
    Shape readers read the past itself.
    """
    readers = list(upcast.output(0).get_target_inputs())
    joins = [r for r in readers if r.get_node().get_type_name() != "ShapeOf"]
    new = list(rounded.output(0).get_target_inputs())
    if len(joins) != 1 or len(new) != 1:
        return
    concat = joins[0].get_node()
    if concat.get_type_name() != "Concat" or new[0].get_node() is not concat:
        return
    consumers = list(concat.output(0).get_target_inputs())
    for reader in readers:
        reader.replace_source_output(param.output(0))
    new[0].replace_source_output(rounded.input_value(0))
    concat.validate_and_infer_types()
    joined = ops.convert(concat.output(0), upcast.get_destination_type())
    for consumer in consumers:
        consumer.replace_source_output(joined.output(0))
