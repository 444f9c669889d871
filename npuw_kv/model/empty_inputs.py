"""Zero-size inputs taken out of a static model.

The prefill model of past 0 (the first rung of the pyramid) still has every past input, each
of shape ``[1, H, 0, D]``: a Parameter whose only uses are the Concat that appends the new KV
and a ShapeOf that reads the past length.  An NPU compile must not get such inputs (NPUW's own
LLM pipeline strips them before compiling; docs/npuw-notes.md), and they bind nothing useful
anywhere.  :func:`drop_empty_inputs` removes them: the Concat keeps its other inputs, the
ShapeOf becomes the constant shape, a Convert between them is passed through.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from ..errors import ModelLayoutError


def drop_empty_inputs(model: ov.Model) -> tuple[str, ...]:
    """Remove ``model``'s inputs of a static shape with a zero dimension; their names.

    A use other than Concat, ShapeOf or Convert is refused (nothing here knows what an empty
    tensor means to it) before anything changes."""
    empty = [p for p in model.get_parameters() if _zero_size(p.get_partial_shape())]
    for param in empty:
        _check_uses(param.output(0), param.get_friendly_name())
    names = []
    for param in empty:
        _bypass(param.output(0))
        model.remove_parameter(param)
        names.append(param.output(0).get_any_name())
    if empty:
        model.validate_nodes_and_infer_types()
    return tuple(names)


def _zero_size(shape: ov.PartialShape) -> bool:
    return shape.is_static and 0 in list(shape.to_shape())


def _check_uses(output: ov.Output, name: str) -> None:
    for use in output.get_target_inputs():
        node = use.get_node()
        kind = node.get_type_name()
        if kind == "Convert":
            _check_uses(node.output(0), name)
        elif kind not in ("Concat", "ShapeOf"):
            raise ModelLayoutError(
                f"zero-size input {name!r} feeds a {kind} node ({node.get_friendly_name()}); "
                "only Concat, ShapeOf and Convert uses can be taken out"
            )


def _bypass(output: ov.Output) -> None:
    """Rewire every use of the empty ``output`` so that nothing reads it."""
    shape = list(output.get_shape())
    for use in list(output.get_target_inputs()):
        node = use.get_node()
        kind = node.get_type_name()
        if kind == "Convert":
            _bypass(node.output(0))
        elif kind == "ShapeOf":
            dtype = node.get_output_element_type(0).to_dtype()
            constant = ops.constant(np.array(shape, dtype))
            node.output(0).replace(constant.output(0))
        else:  # Concat: the same result from its other inputs
            rest = [
                node.input_value(i) for i in range(node.get_input_size()) if i != use.get_index()
            ]
            if len(rest) == 1:
                node.output(0).replace(rest[0])
            else:
                joined = ops.concat(rest, node.get_axis())
                joined.set_friendly_name(node.get_friendly_name())
                node.output(0).replace(joined.output(0))
