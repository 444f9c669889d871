"""Rewrites of the attention ops themselves: the GQA broadcast a static reshape cannot take,
the per-step KV head expansion folded into the query rows, and the softmax scale moved onto
the query.  Each mutates the model it is given and returns how many ops it changed.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops


def fix_gqa_broadcast(model: ov.Model) -> int:
    """Let GQA key/value expansion survive a static reshape.

    The GGUF-converted IR expands KV heads with a bidirectional Broadcast whose target shape is
    a Concat holding a literal 0 in the sequence slot.  With a dynamic sequence that slips
    through; with a static one shape inference refuses it (target 0 vs. 1024).  A 1 broadcasts
    to the same result, so the constant is replaced, and so is a length the export computes
    from other tensors' shapes (gpt-oss: another layer's past, which after the static reshape
    need not be this layer's).
    """
    fixed = 0
    for node in model.get_ordered_ops():
        if node.get_type_name() != "Broadcast":
            continue
        if node.get_attributes().get("mode") != "bidirectional":
            continue
        target = node.input(1).get_source_output().get_node()
        if target.get_type_name() != "Concat":
            continue
        # a GQA expansion (KV heads unsqueezed, then broadcast to the group): only its group
        # axis grows, so a target length equal to the input's may as well be 1
        expands = node.input(0).get_source_output().get_node().get_type_name() == "Unsqueeze"
        dims = node.input(0).get_partial_shape()
        axis = 0
        for port in target.inputs():
            src = port.get_source_output().get_node()
            size = port.get_partial_shape()
            width = size[0].get_length() if size.rank.is_static and size[0].is_static else None
            if src.get_type_name() == "Constant":
                value = src.get_data()
                if value.size == 1 and int(value.reshape(-1)[0]) == 0:
                    one = ops.constant(np.ones_like(value))
                    port.replace_source_output(one.output(0))
                    fixed += 1
            elif expands and width == 1 and dims.rank.is_static and axis < dims.rank.get_length():
                # a computed length (gpt-oss: the sequence, from another layer's past and the
                # input's length): after the static reshape it need not be this layer's (a
                # sliding-window ring), and 1 broadcasts to the input's own length anyway
                dim = dims[axis]
                if not (dim.is_static and dim.get_length() == 1):
                    one = np.ones(1, port.get_element_type().to_dtype())
                    port.replace_source_output(ops.constant(one).output(0))
                    fixed += 1
            if width is None:
                break  # the axes of the entries after this one are not known
            axis += width
    model.validate_nodes_and_infer_types()
    return fixed


def fold_gqa_into_attention(model: ov.Model) -> int:
    """Attend with the KV heads as they are instead of expanding them for every query head.

    The IR repeats each KV head ``group`` times (Unsqueeze -> Broadcast -> Reshape) before
    SDPA, materialising ``group`` copies of the whole past on every step.  Folding the query
    heads of one group into the query-length axis (``[B, Hq, L, D] -> [B, Hkv, group*L, D]``,
    mask rows tiled ``group`` times) computes the same attention with no copy of K or V.
    Returns the number of attention ops rewritten.
    """
    folded = 0
    for sdpa in model.get_ordered_ops():
        if sdpa.get_type_name() != "ScaledDotProductAttention" or sdpa.get_input_size() < 4:
            continue
        key = _gqa_source(sdpa.input(1).get_source_output())
        value = _gqa_source(sdpa.input(2).get_source_output())
        query = sdpa.input(0).get_source_output()
        q_shape, mask = query.get_partial_shape(), sdpa.input(3).get_source_output()
        if (
            key is None
            or value is None
            or q_shape.rank.get_length() != 4
            or mask.get_partial_shape().rank.get_length() != 4
        ):
            continue
        if sdpa.get_input_size() > 5:
            # a sink (gpt-oss: a learned logit per query head in the softmax) is per head;
            # folded heads share rows, so that attention keeps its expanded KV
            continue
        kv_heads = key.get_partial_shape()[1]
        q_heads, head_dim = q_shape[1], q_shape[3]
        if not (kv_heads.is_static and q_heads.is_static and head_dim.is_static):
            continue
        group = q_heads.get_length() // kv_heads.get_length()
        if group * kv_heads.get_length() != q_heads.get_length() or group == 1:
            continue
        d = head_dim.get_length()
        q = ops.reshape(
            query, ops.constant(np.array([0, kv_heads.get_length(), -1, d], np.int64)), True
        )
        tiled = ops.concat([mask] * group, 2)
        extra = [sdpa.input(4).get_source_output()] if sdpa.get_input_size() > 4 else []
        causal = bool(sdpa.get_attributes().get("causal", False))
        attn = ops.scaled_dot_product_attention(q, key, value, tiled, *extra, causal=causal)
        out = ops.reshape(
            attn, ops.constant(np.array([0, q_heads.get_length(), -1, d], np.int64)), True
        )
        for target in list(sdpa.output(0).get_target_inputs()):
            target.replace_source_output(out.output(0))
        folded += 1
    model.validate_nodes_and_infer_types()
    return folded


def scale_query_for_attention(model: ov.Model) -> int:
    """Apply each attention's softmax scale to the query, and give SDPA a scale of 1.

    Without a fused SDPA kernel (the CPU plugin keeps one only in stateful graphs) the
    decomposed attention multiplies the whole concatenated K by the scale and transposes it as a
    separate node: two extra passes over the past on every step (about a fifth of a SmolLM2
    decode step by PERF_COUNT).  Scaling the query instead touches ``L x D`` values, and with
    a scale of 1 the plugin reads K straight into its attention kernel.  For a power-of-two
    scale (head_dim 64: 1/8) the result is bit-identical.  Returns the number of ops rewritten.
    """
    rewritten = 0
    for sdpa in model.get_ordered_ops():
        if sdpa.get_type_name() != "ScaledDotProductAttention" or sdpa.get_input_size() < 4:
            continue
        query = sdpa.input(0).get_source_output()
        dtype = query.get_element_type()
        if sdpa.get_input_size() > 4:
            scale = sdpa.input(4).get_source_output()
        else:
            head_dim = query.get_partial_shape()[-1]
            if not head_dim.is_static:
                continue
            scale = ops.constant(np.array(1 / np.sqrt(head_dim.get_length()), np.float32)).output(0)
        if scale.get_element_type() != dtype:
            scale = ops.convert(scale, dtype).output(0)
        one = ops.convert(ops.constant(np.array(1, np.float32)), dtype).output(0)
        scaled = ops.multiply(query, scale).output(0)
        if sdpa.get_input_size() > 4:  # the op kept, and with it every input (a sink too)
            sdpa.input(0).replace_source_output(scaled)
            sdpa.input(4).replace_source_output(one)
        else:
            ins = [sdpa.input(i).get_source_output() for i in range(1, 4)]
            causal = bool(sdpa.get_attributes().get("causal", False))
            attn = ops.scaled_dot_product_attention(scaled, *ins, one, causal=causal)
            attn.set_friendly_name(sdpa.get_friendly_name())
            sdpa.output(0).replace(attn.output(0))
        rewritten += 1
    model.validate_nodes_and_infer_types()
    return rewritten


def _gqa_source(value: ov.Output) -> ov.Output | None:
    """``x`` if ``value`` is Reshape(Broadcast(Unsqueeze(x))) — the GQA head expansion."""
    reshape = value.get_node()
    if reshape.get_type_name() != "Reshape":
        return None
    broadcast = reshape.input(0).get_source_output().get_node()
    if broadcast.get_type_name() != "Broadcast":
        return None
    unsqueeze = broadcast.input(0).get_source_output().get_node()
    if unsqueeze.get_type_name() != "Unsqueeze":
        return None
    return unsqueeze.input(0).get_source_output()


def let_every_row_attend(model: ov.Model) -> int:
    """Let each query row attend to its own key under a boolean attention mask.

    A chunk's front padding is a row whose keys are all masked (the padding before it and
    itself): with a boolean mask, softmax over no key is NaN (OLMo 2's export), the NaN goes
    into that row's K/V in the next layer, and every real row then reads ``0 * NaN``.  Its
    own key makes the padded row finite (its output is never used); a real row attends to its
    own key already.  The new tokens are the last keys, so row ``q`` owns key
    ``q + keys - queries``.  Returns the number of attention ops changed.
    """
    changed = 0
    zero, one, axis = (ops.constant(np.int64(v)) for v in (0, 1, 2))
    for sdpa in model.get_ordered_ops():
        if sdpa.get_type_name() != "ScaledDotProductAttention" or sdpa.get_input_size() < 4:
            continue
        mask = sdpa.input(3).get_source_output()
        if mask.get_element_type() != ov.Type.boolean:
            continue
        queries = ops.gather(ops.shape_of(sdpa.input_value(0)), axis, zero)
        keys = ops.gather(ops.shape_of(sdpa.input_value(1)), axis, zero)
        own = ops.add(ops.range(zero, queries, one, ov.Type.i64), ops.subtract(keys, queries))
        diagonal = ops.equal(ops.unsqueeze(own, one), ops.range(zero, keys, one, ov.Type.i64))
        sdpa.input(3).replace_source_output(ops.logical_or(mask, diagonal).output(0))
        changed += 1
    model.validate_nodes_and_infer_types()
    return changed
