"""Shapes a static model still leaves to run time.

After the static reshape every shape of an LLM's graph is known, except where the graph itself
makes one from data: a mixture of experts that routes tokens to experts by slicing the rows
each expert got (granitemoe's export) has as many rows per expert as the router chose.  The CPU
plugin runs such a graph; the NPU compiler takes static shapes only, and fails deep inside
with "to_shape was called on a dynamic shape", so the NPU path refuses the model first.
"""

from __future__ import annotations

import openvino as ov

from ..errors import ModelLayoutError


def run_time_shapes(model: ov.Model) -> list[ov.Node]:
    """The ops of ``model`` with an output shape not known before it runs."""
    return [
        op
        for op in model.get_ordered_ops()
        if any(op.get_output_partial_shape(i).is_dynamic for i in range(op.get_output_size()))
    ]


def refuse_run_time_shapes(model: ov.Model, device: str) -> None:
    """A ``ModelLayoutError`` naming the first op whose shape ``model`` leaves to run time,
    for a device that compiles static shapes only."""
    ops = run_time_shapes(model)
    if not ops:
        return
    first = ops[0]
    moe = any("moe" in op.get_friendly_name().lower() for op in ops)
    why = "its mixture of experts routes tokens" if moe else "its graph computes shapes"
    raise ModelLayoutError(
        f"{why} with shapes known only at run time ({len(ops)} ops, first "
        f"{first.get_type_name()} {first.get_friendly_name()!r}), and the {device} compiles "
        "static shapes only: run this model on device='CPU'"
    )
