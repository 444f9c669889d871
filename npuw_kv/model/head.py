"""The LM head's MatMul behind a model's logits output.

A rewrite that cuts the head to the rows it needs (the last token of each sequence), and the
NPU path's split into embedding, body and head, both start from it.  Some models change each
token's logits after the head (a final scaling or softcapping): those steps work token by
token, so they are walked through and kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import openvino as ov

from ..errors import ModelLayoutError

# what a model may do to each token's logits after its LM head: Gemma 2's final softcapping
# (Divide or Multiply by a constant, Tanh, Multiply), Granite's logits_scaling (Divide)
_UNARY_AFTER_HEAD = ("Convert", "Tanh")
_BINARY_AFTER_HEAD = ("Multiply", "Divide", "Add", "Subtract")


def _constant(output: ov.Output) -> bool:
    node = output.get_node()
    while node.get_type_name() == "Convert":
        node = node.input_value(0).get_node()
    return node.get_type_name() == "Constant"


def head_matmul(logits: ov.Node, through: Sequence[str] = ()) -> ov.Node:
    """The LM head's MatMul behind the ``logits`` Result: through Converts, a Tanh, and
    elementwise arithmetic with a constant (a model's scaling or softcapping of its logits,
    which works token by token and so keeps working on the rows the head is cut to), and
    through the op types in ``through``."""
    node = logits.input_value(0).get_node()
    while node.get_type_name() != "MatMul":
        kind = node.get_type_name()
        unary = kind in _UNARY_AFTER_HEAD or kind in through
        if not unary and kind not in _BINARY_AFTER_HEAD:
            raise ModelLayoutError(f"logits are not produced by a MatMul (got {kind})")
        # a binary step: the side that is not a constant leads back to the head
        follow = 1 if not unary and _constant(node.input_value(0)) else 0
        if not unary and not _constant(node.input_value(1 - follow)):
            raise ModelLayoutError(f"logits come from a {kind} of two computed values")
        node = node.input_value(follow).get_node()
    return node
