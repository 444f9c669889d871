"""State a model keeps besides its KV cache: which path holds it, and refusals naming why.

Hybrid models (Granite 4.0-H's Mamba-2 layers, Qwen3.5's gated DeltaNet, LFM2's short
convolutions) carry a fixed-size state per layer beside the attention layers' KV.  The paged
rewrite turns each into a state table the block manager addresses by slots
(:mod:`npuw_kv.kv.blocks.state_slots`), so the PagedAttention path runs them; the static-shape
and NPU paths hold KV only and refuse such a model when it loads, by name, instead of failing
in the plugin or with a wrong reason.  A state the rewrite leaves as a variable, or a table
the device does not write (its op computes without storing the state: every token after the
first would be wrong), is refused on the paged path too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import openvino as ov

from ..errors import ModelLayoutError

_KV = re.compile(r"key|value", re.IGNORECASE)
# what the exports call the other states (Mamba's conv and ssm, DeltaNet's recurrent state);
# a variable named otherwise is left to the layout's own checks, which pair KV by structure
_OTHER = re.compile(r"ssm|conv|recurrent|mamba|delta|linear|state", re.IGNORECASE)


def other_states(model: ov.Model) -> list[str]:
    """The kinds of state ``model`` keeps that are not K or V (``ssm``, ``conv``, ...)."""
    kinds: set[str] = set()
    for variable in model.get_variables():
        name = variable.get_info().variable_id
        if _KV.search(name) or not _OTHER.search(name):
            continue
        past = name.split("present")[0]  # optimum: "<past name><present name>"
        kinds.add(re.sub(r"[\d._]+", " ", past.replace("cache_params", "")).split()[-1])
    return sorted(kinds)


def refuse_on_static_path(kinds: list[str]) -> None:
    """A ``ModelLayoutError`` for a model holding state other than KV on the static-shape or
    NPU path."""
    if kinds:
        raise ModelLayoutError(
            f"it keeps state other than the KV cache ({', '.join(kinds)}: linear-attention or "
            "state-space layers), which the static-shape and NPU paths do not hold; the "
            "PagedAttention path holds it (device 'CPU', attention_backend 'pa', the CPU's "
            "default)"
        )


def refuse_unpaged_states(paged: ov.Model) -> None:
    """A ``ModelLayoutError`` when the paged rewrite left a state as a variable (a layer kind
    OpenVINO's rewrite has no paged op for)."""
    left = sorted(n.get_variable_id() for n in paged.get_ops() if n.get_type_name() == "ReadValue")
    if left:
        raise ModelLayoutError(
            f"OpenVINO's PagedAttention rewrite left its state {', '.join(left)} unpaged (no "
            "paged op for that layer kind), which npuw-kv cannot hold; "
            "openvino_genai.LLMPipeline(..., ATTENTION_BACKEND='SDPA') runs it"
        )


def refuse_unwritten_states(unwritten: list[str], ops: Mapping[str, list[str]]) -> None:
    """A ``ModelLayoutError`` naming the state tables the device did not write, and their
    ops."""
    if unwritten:
        kinds = sorted({op for name in unwritten for op in ops.get(name, [])})
        raise ModelLayoutError(
            f"the CPU plugin of OpenVINO {ov.get_version().split('-')[0]} does not store the "
            f"state of its {', '.join(kinds)} ({', '.join(unwritten)} stay zero after a "
            "call), so every token after the first would be wrong; openvino_genai's "
            "continuous batching runs the same op (its default on the CPU) and answers "
            "wrong too, openvino_genai.LLMPipeline(..., ATTENTION_BACKEND='SDPA') runs it right"
        )


def refuse_positions_from_cache_length(wrong: int) -> None:
    """A ``ModelLayoutError`` for a paged model whose attention numbers a call's tokens from
    the cache length (:func:`~.paged_rewrite.positions_from_cache_length`)."""
    if wrong:
        raise ModelLayoutError(
            f"{wrong} of its attention layers take their rotary positions from the cache length "
            "instead of position_ids (the export numbers tokens from the past length), which "
            "OpenVINO's PagedAttention rewrite turns into one position for every token of a "
            "prefill chunk: its answers would be wrong. Export it so that its attention takes "
            "position_ids, or run it with openvino_genai.LLMPipeline(..., "
            "ATTENTION_BACKEND='SDPA')"
        )
