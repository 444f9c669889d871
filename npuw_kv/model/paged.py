"""The PagedAttention form of a stateful LLM IR, for the CPU plugin's paged-attention kernel.

On CPU the stateless graph loses the plugin's fused attention (it keeps it only for its own
stateful KV states), so attention runs decomposed: snippet kernels compiled per layer and
score buffers sized by the prefill chunk.  The plugin's ``PagedAttentionExtension`` op reads
and writes a KV cache that *we* allocate and index (one tensor per layer for K and for V,
addressed through a block table), quantises it to u8 by default, and attends without those
buffers.  One compiled model serves prefill chunks and generate steps over the same cache.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
from openvino._offline_transformations import paged_attention_transformation

from .layout import ModelLayoutError

CACHE_PREFIXES = ("key_cache.", "value_cache.")


def cache_inputs(model: ov.Model | ov.CompiledModel) -> list[ov.Output]:
    """The KV cache inputs of a paged model, K and V of every layer."""
    return [i for i in model.inputs if i.get_any_name().startswith(CACHE_PREFIXES)]


def make_paged(model: ov.Model, full_logits: bool = False) -> ov.Model:
    """Rewrite ``model`` (stateful, in place) to PagedAttention with last-token logits.

    ``full_logits`` keeps the LM head on every token (perplexity only, as in ``prepare``).
    """
    try:
        paged_attention_transformation(model, False, False)
    except RuntimeError as exc:
        raise ModelLayoutError(f"cannot rewrite the model to PagedAttention: {exc}") from exc
    if not cache_inputs(model):
        raise ModelLayoutError("no attention with a KV cache found: not a decoder LLM")
    if not full_logits:
        _logits_for_last_token(model)
    return model


def _logits_for_last_token(model: ov.Model) -> None:
    """The LM head on the last token only: in a paged model tokens run along axis 0."""
    logits = [o for o in model.outputs if "logits" in o.get_names()]
    if not logits:
        raise ModelLayoutError("the model has no 'logits' output")
    head = logits[0].get_node().input(0).get_source_output().get_node()
    while head.get_type_name() == "Convert":
        head = head.input(0).get_source_output().get_node()
    if head.get_type_name() != "MatMul":
        raise ModelLayoutError(f"logits are not produced by a MatMul (got {head.get_type_name()})")
    hidden = head.input(0).get_source_output()
    last = ops.slice(
        hidden,
        ops.constant(np.array([-1], np.int64)),
        ops.constant(np.array([np.iinfo(np.int64).max], np.int64)),
        ops.constant(np.array([1], np.int64)),
        ops.constant(np.array([0], np.int64)),
    )
    head.input(0).replace_source_output(last.output(0))
    model.validate_nodes_and_infer_types()
