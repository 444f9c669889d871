"""The PagedAttention form of a stateful LLM IR, for the CPU plugin's paged-attention kernel.

On CPU the stateless graph loses the plugin's fused attention (it keeps it only for its own
stateful KV states), so attention runs decomposed: snippet kernels compiled per layer and
score buffers sized by the prefill chunk.  The plugin's ``PagedAttentionExtension`` op reads
and writes a KV cache that *we* allocate and index (one tensor per layer for K and for V,
addressed through a block table), quantises it to u8 by default, and attends without those
buffers.  One compiled model serves prefill chunks and generate steps over the same cache.
"""

from __future__ import annotations

import openvino as ov
from openvino._offline_transformations import paged_attention_transformation

from .layout import ModelLayoutError
from .transforms import lm_head_on_last

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
    lm_head_on_last(model, logits[0].get_node(), axis=0)
