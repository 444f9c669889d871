"""State a model keeps besides its KV cache.

Hybrid models (Granite 4.0-H's Mamba-2 layers, Qwen3.5's gated DeltaNet, LFM2's short
convolutions) carry a fixed-size state per layer beside the attention layers' KV.  npuw-kv's
paths hold KV only, so such a model is refused when it loads, by name, instead of failing in the
plugin at the first step (the paged path) or with a wrong reason (the static path).
"""

from __future__ import annotations

import re

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


def refuse_other_states(model: ov.Model) -> None:
    """A ``ModelLayoutError`` for a model holding state other than KV."""
    kinds = other_states(model)
    if kinds:
        raise ModelLayoutError(
            f"it keeps state other than the KV cache ({', '.join(kinds)}: linear-attention or "
            "state-space layers), which npuw-kv's paths do not hold yet; openvino_genai."
            "LLMPipeline runs it on the CPU"
        )
