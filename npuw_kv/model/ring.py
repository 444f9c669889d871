"""Sliding-window layers that keep their KV in a ring of window + one chunk of slots.

A layer with window W reads only the W - 1 tokens before each query, so on the static-shape
path its KV needs no more than the window plus the chunk being written while that window is
read: ``R = ceil((W + C - 1) / C) * C`` slots, written circularly (token slot ``s`` lands in
ring slot ``s mod R``; R a multiple of C keeps a fresh prompt's chunks from wrapping).  The
full-attention layers keep the whole past.  Gemma 3 at a 32k context then holds the KV of
its 3 full layers plus 15 rings of 768 slots instead of 18 full pasts.

A ring's slots are not in token order, so neither the slot index (the graph's own mask) nor
the count of live slots before a key (:mod:`.window`'s rewrite) gives a key's position.  Each
windowed attention takes its mask as an input instead, ``window_mask.{W}`` ``[1, 1, T, R + T]``
(additive: 0 or -inf, in f16, which holds both exactly), which the runtime computes from the
token it wrote into each slot (:mod:`npuw_kv.runtime.static.rings`).  Not f32: the CPU plugin
(OpenVINO 2026.4) computes bf16 attention wrong when its mask is an f32 input of one row
(``[1, 1, 1, S]``: a generate step), NaN or wrong tokens from the first step on (Gemma 2's
windows at the CPU's default bf16); an f16 input converted in the graph is read right.  The
full layers keep the graph's mask.  A transformers export reads that mask's key count off
the *first* layer's past (``ShapeOf(past 0)``); when the first layer is windowed its past is
now the ring, so such reads are pointed at a full layer's past.
"""

from __future__ import annotations

from dataclasses import replace

import openvino as ov
import openvino.opset13 as ops

from ..errors import ModelLayoutError
from .layout import KVLayout
from .window import attention_layer


def mask_input(window: int) -> str:
    """The name of the mask input of the attentions of window ``window``."""
    return f"window_mask.{window}"


def _param(model: ov.Model, name: str) -> ov.Node:
    return next(p for p in model.get_parameters() if name in p.output(0).get_names())


def give_rings(model: ov.Model, layout: KVLayout, rings: tuple[tuple[int, int], ...]) -> KVLayout:
    """Give every attention of a ringed window its mask input (module docstring) and point
    the graph's reads of a ringed past's length at a full layer's; ``layout`` with ``rings``.

    Call before the attention rewrites (``attention.py``): they carry the new mask along.
    """
    if not rings:
        return layout
    ringed = {w for w, _ in rings}
    key_layers = {p.input_name: p.layer for p in layout.ports if p.kind == "key"}
    masks: dict[int, ov.Node] = {}
    rewired = set()
    for sdpa in model.get_ordered_ops():
        if sdpa.get_type_name() != "ScaledDotProductAttention" or sdpa.get_input_size() < 4:
            continue
        layer = attention_layer(sdpa, key_layers)
        window = layout.window[layer] if layer is not None else None
        if window not in ringed:
            continue
        assert window is not None and layer is not None
        if window not in masks:
            mask = ops.parameter([1, 1, -1, -1], ov.Type.f16, name=mask_input(window))
            mask.output(0).set_names({mask_input(window)})
            masks[window] = mask
        source = ops.convert(masks[window], sdpa.input(3).get_element_type()).output(0)
        sdpa.input(3).replace_source_output(source)
        rewired.add(layer)
    missing = {p.layer for p in layout.ports if layout.window[p.layer] in ringed} - rewired
    if missing:
        raise ModelLayoutError(
            f"layers {sorted(missing)} have a sliding window but no attention op this rewrite "
            "can give a ring mask; set window_kv='full'"
        )
    full = {p.kind: p.input_name for p in layout.ports if layout.window[p.layer] is None}
    for port in layout.ports:
        if layout.window[port.layer] not in ringed or port.kind not in full:
            continue
        past = _param(model, port.input_name).output(0)
        for target in list(past.get_target_inputs()):
            if target.get_node().get_type_name() == "ShapeOf":
                target.replace_source_output(_param(model, full[port.kind]).output(0))
    model.add_parameters(list(masks.values()))
    model.validate_nodes_and_infer_types()
    return replace(layout, rings=rings)
