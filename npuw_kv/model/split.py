"""Cut the token embedding and the LM head out of the prepared model.

Every model NPUW compiles keeps its own copy of what lies outside the repeated layers: the
embedding table it gathers from on the host and the LM head's matrix (on SmolLM2 each is 49152 x
576; a second compile of one static model costs far less once both are cut: docs/measurements.md,
"Figures behind the code's choices").  A ladder of static models by past length (pyramid prefill,
generate variants) would pay that per model.  So the static-shape path runs three parts instead: the
embedding gather compiled once (dynamic length, CPU), the body (one static model per shape, taking
``inputs_embeds`` and returning the last position's hidden state, weights in one NPUW bank), and the
head compiled once on the body's device.  This is what NPUW's own ``NPUW_LLM_SHARED_HEAD`` does for
the head.
"""

from __future__ import annotations

from dataclasses import dataclass

import openvino as ov
import openvino.opset13 as ops

from ..errors import ModelLayoutError
from .head import head_matmul
from .layout import KVLayout

EMBEDS_INPUT = "inputs_embeds"
HIDDEN_OUTPUT = "last_hidden_state"


@dataclass
class SplitModel:
    """The three parts; ``body`` keeps the prepared model's inputs and output order, with
    ``inputs_embeds`` for ``input_ids`` and the hidden state where the logits were."""

    embed: ov.Model  # input_ids [1, T] -> inputs_embeds [1, T, hidden]
    body: ov.Model
    head: ov.Model  # hidden [1, 1, hidden] -> logits [1, 1, vocab]
    hidden_size: int


def parameter_free(output: ov.Output, memo: dict[str, bool]) -> bool:
    """Whether ``output`` is computed from constants alone (a weight, decompressed or not)."""
    node = output.get_node()
    key = node.get_name()
    if key not in memo:
        if node.get_type_name() == "Parameter":
            memo[key] = False
        else:
            memo[key] = all(parameter_free(i.get_source_output(), memo) for i in node.inputs())
    return memo[key]


def _reachable(model: ov.Model) -> set[str]:
    """Unique names of the nodes the model's outputs depend on."""
    seen: set[str] = set()
    stack = [r for r in model.get_results()]
    while stack:
        node = stack.pop()
        if node.get_name() in seen:
            continue
        seen.add(node.get_name())
        stack.extend(i.get_source_output().get_node() for i in node.inputs())
    return seen


def _input_ids(model: ov.Model) -> ov.Node:
    for param in model.get_parameters():
        if "input_ids" in param.output(0).get_names() | {param.get_friendly_name()}:
            return param
    raise ModelLayoutError("model has no input_ids input; cannot cut out its embedding")


def _embedding_gather(model: ov.Model) -> ov.Node:
    """The Gather that reads the embedding rows of ``input_ids`` (through Converts only)."""
    frontier = [_input_ids(model).output(0)]
    while frontier:
        out = frontier.pop()
        for target in out.get_target_inputs():
            node = target.get_node()
            if node.get_type_name() == "Convert":
                frontier.append(node.output(0))
            elif node.get_type_name() == "Gather" and target.get_index() == 1:
                return node
    raise ModelLayoutError("no embedding Gather fed by input_ids; cannot cut out the embedding")


def _head_matmul(model: ov.Model, layout: KVLayout) -> ov.Node:
    """The LM head's MatMul above the logits output: input 0 the hidden state, 1 a weight."""
    logits = model.outputs[layout.logits_output_index].get_node()
    node = head_matmul(logits, through=("Reshape", "Squeeze", "Unsqueeze"))
    memo: dict[str, bool] = {}
    weight = [parameter_free(node.input_value(i), memo) for i in range(2)]
    if weight != [False, True]:
        raise ModelLayoutError("the LM head's MatMul does not multiply the hidden by a weight")
    return node


def split_model(model: ov.Model, layout: KVLayout) -> SplitModel:
    """Cut ``model`` (prepared, logits of the last position only) into embed / body / head."""
    head_src = model.clone()
    embed_src = model.clone()

    # the head: a new input in place of the hidden state, up to the logits
    matmul = _head_matmul(head_src, layout)
    hidden_size = matmul.input_value(0).get_partial_shape()[-1].get_length()
    hidden = ops.parameter([1, 1, hidden_size], matmul.input_value(0).get_element_type())
    hidden.output(0).set_names({HIDDEN_OUTPUT})
    matmul.input(0).replace_source_output(hidden.output(0))
    head = ov.Model([head_src.outputs[layout.logits_output_index].get_node()], [hidden], "head")
    head.validate_nodes_and_infer_types()  # static from the new input on

    # the embedding: input_ids -> the gathered rows
    gather = _embedding_gather(embed_src)
    embed_ids = _input_ids(embed_src)
    result = ops.result(gather.output(0))
    result.output(0).set_names({EMBEDS_INPUT})
    embed = ov.Model([result], [embed_ids], "embed")

    # the body: inputs_embeds in, the hidden state out where the logits were
    gather = _embedding_gather(model)
    embeds = ops.parameter(gather.get_output_partial_shape(0), gather.get_output_element_type(0))
    embeds.set_friendly_name(EMBEDS_INPUT)
    embeds.output(0).set_names({EMBEDS_INPUT})
    for target in list(gather.output(0).get_target_inputs()):
        target.replace_source_output(embeds.output(0))
    model.add_parameters([embeds])
    model.outputs[layout.logits_output_index].get_node().input(0).replace_source_output(
        _head_matmul(model, layout).input_value(0)
    )
    model.outputs[layout.logits_output_index].get_tensor().set_names({HIDDEN_OUTPUT})
    ids = _input_ids(model)
    if ids.get_name() not in _reachable(model):  # only the cut-off gather read it
        model.remove_parameter(ids)
    model.validate_nodes_and_infer_types()
    return SplitModel(embed, model, head, hidden_size)
