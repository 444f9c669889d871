"""Sliding-window attention: find each layer's window, and make its mask count token positions.

A model exported from transformers builds a sliding-window layer's mask as
``kv_idx > q_idx - window`` (next to the causal ``kv_idx <= q_idx``), numbering keys and queries
by their index along the attention's KV axis.  A stateful cache makes that index the token's
position.  Our static-shape layouts do not: NPU prefill reads a fixed-length past whose slots
after the prompt are not written yet, and a generate step's token is appended after the whole
buffer, not at its own slot.  Causality survives (every past slot precedes the new tokens, and
unwritten ones are masked), the window does not: a step would attend to the buffer's empty end.

:func:`rewrite_window_masks` therefore compares positions instead, read off the attention mask
the runtime passes: the position of a key is the number of live slots before it
(``cumsum(mask) - 1``, what its index is in a stateful cache), and a query's is its key's.
The PagedAttention rewrite (``paged_rewrite.py``) needs none of this: OpenVINO's own transformation
hands the window to the kernel.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from ..errors import ModelLayoutError
from .layout import KVLayout

_WALK_LIMIT = 400  # nodes visited per search: masks and K inputs sit within a few dozen


@dataclass(frozen=True)
class WindowCompare:
    """One ``Greater(kv_row, q_column + offset)``: the keys within ``window`` of a query."""

    node: ov.Node
    offset: ov.Output  # the constant (-window), kept as the graph has it

    @property
    def window(self) -> int:
        return -int(self.offset.get_node().get_data().ravel()[0])


def _ancestors(start: ov.Output) -> Iterator[ov.Node]:
    """Nodes above ``start``, breadth first, not past Parameters or Constants."""
    seen: set[str] = set()
    queue = [start.get_node()]
    while queue and len(seen) < _WALK_LIMIT:
        node = queue.pop(0)
        if node.get_friendly_name() in seen:
            continue
        seen.add(node.get_friendly_name())
        yield node
        if node.get_type_name() not in ("Parameter", "Constant"):
            queue += [i.get_source_output().get_node() for i in node.inputs()]


def _as_window_compare(node: ov.Node) -> WindowCompare | None:
    """``node`` if it is ``kv[1,1,1,K] > q[1,1,Q,1] + c`` with one negative integer ``c``."""
    if node.get_type_name() != "Greater":
        return None
    kv, shifted = (node.input(i).get_source_output() for i in (0, 1))
    add = shifted.get_node()
    if add.get_type_name() != "Add":
        return None
    const = next(
        (
            add.input(i).get_source_output()
            for i in (0, 1)
            if add.input(i).get_source_output().get_node().get_type_name() == "Constant"
        ),
        None,
    )
    if const is None or not const.get_element_type().is_integral():
        return None
    values = np.unique(const.get_node().get_data())
    kv_shape, q_shape = kv.get_partial_shape(), shifted.get_partial_shape()
    row = kv_shape.rank.get_length() == 4 and all(
        d.is_static and d.get_length() == 1 for d in list(kv_shape)[:3]
    )
    column = (
        q_shape.rank.get_length() == 4 and q_shape[3].is_static and q_shape[3].get_length() == 1
    )
    if len(values) != 1 or values[0] >= 0 or not (row and column):
        return None
    return WindowCompare(node, const)


def attention_layer(sdpa: ov.Node, key_layers: dict[str, int]) -> int | None:
    """The layer whose past keys (input name -> layer) reach this attention's K input."""
    for node in _ancestors(sdpa.input(1).get_source_output()):
        if node.get_type_name() == "Parameter":
            for name in node.output(0).get_names() | {node.get_friendly_name()}:
                if name in key_layers:
                    return key_layers[name]
    return None


def find_windows(
    model: ov.Model, layout: KVLayout
) -> tuple[tuple[int | None, ...], list[WindowCompare]]:
    """The attention window of every layer (None: full) and the window comparisons found."""
    windows: list[int | None] = [None] * layout.num_layers
    compares: dict[str, WindowCompare] = {}
    key_layers = {p.input_name: p.layer for p in layout.ports if p.kind == "key"}
    for sdpa in model.get_ordered_ops():
        if sdpa.get_type_name() != "ScaledDotProductAttention" or sdpa.get_input_size() < 4:
            continue
        found = [
            c
            for n in _ancestors(sdpa.input(3).get_source_output())
            if (c := _as_window_compare(n)) is not None
        ]
        if not found:
            continue
        layer = attention_layer(sdpa, key_layers)
        if layer is None:
            raise ModelLayoutError(
                f"attention {sdpa.get_friendly_name()!r} has a sliding-window mask but no "
                "past keys of a known layer"
            )
        windows[layer] = min(c.window for c in found)
        compares.update((c.node.get_friendly_name(), c) for c in found)
    return tuple(windows), list(compares.values())


def rewrite_window_masks(model: ov.Model, compares: list[WindowCompare]) -> int:
    """Make each window comparison compare token positions (module docstring); returns how many."""
    if not compares:
        return 0
    mask = next(p for p in model.get_parameters() if "attention_mask" in p.output(0).get_names())
    ids = next(p for p in model.get_parameters() if "input_ids" in p.output(0).get_names())
    i64 = ov.Type.i64
    one = ops.constant(np.array(1, np.int64))
    positions = ops.subtract(ops.cumsum(ops.convert(mask, i64), ops.constant(np.array(1))), one)
    new_tokens = ops.gather(ops.shape_of(ids, i64), ops.constant(np.array([1])), 0)
    query_positions = ops.slice(
        positions,
        ops.negative(new_tokens),
        ops.constant(np.array([np.iinfo(np.int64).max])),
        ops.constant(np.array([1])),
        ops.constant(np.array([1])),
    )
    key_row = ops.reshape(positions, ops.constant(np.array([1, 1, 1, -1])), False)
    query_column = ops.reshape(query_positions, ops.constant(np.array([1, 1, -1, 1])), False)
    for compare in compares:
        offset = compare.offset
        if offset.get_element_type() != i64:
            offset = ops.convert(offset, i64).output(0)
        greater = ops.greater(key_row, ops.add(query_column, offset))
        greater.set_friendly_name(compare.node.get_friendly_name())
        compare.node.output(0).replace(greater.output(0))
    model.validate_nodes_and_infer_types()
    return len(compares)


def apply_windows(model: ov.Model, layout: KVLayout, declared: int | None = None) -> KVLayout:
    """Find the windows, rewrite their masks, and return ``layout`` with ``window`` per layer.

    ``declared``: the window the model's config names; a model that declares one whose mask
    this module cannot find is refused rather than run over the whole past.
    """
    windows, compares = find_windows(model, layout)
    if declared is not None and not compares:
        raise ModelLayoutError(
            f"the model declares sliding-window attention (window {declared}) but its mask "
            "is not the form this rewrite knows (kv_idx > q_idx - window), so the static-shape "
            "path would attend outside the window; on CPU use attention_backend='pa'"
        )
    rewrite_window_masks(model, compares)
    return replace(layout, window=windows)
