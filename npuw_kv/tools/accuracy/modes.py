"""What each accuracy mode runs (pipeline settings) and what it is held to.

A mode is a way to run the model (the paged or static-shape path, a KV precision, a binding, the
variant ladders, transposed V, the device's own defaults); its tolerance is the largest max
|dlogit| against the exact f32 reference it may show with every greedy token equal.
"""

from __future__ import annotations

from typing import Any

from ...config.settings import EXACT_F32

# The parts of the CPU's defaults one at a time (device-default switches on u8 KV blocks, bf16
# compute and int8 dynamic quantization of activations at once), on the PagedAttention path:
# what each part costs against the f32 reference.  Reported, never gated.
_NO_DYN_QUANT = {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}
DEFAULT_PARTS: dict[str, dict[str, Any]] = {
    "u8-kv": {**EXACT_F32, "kv_precision": "u8"},
    "u8-kv+dyn-quant": {"INFERENCE_PRECISION_HINT": "f32", "kv_precision": "u8"},
    "u8-kv+bf16": {**_NO_DYN_QUANT, "kv_precision": "u8"},
    "bf16-kv+bf16": {**_NO_DYN_QUANT, "kv_precision": "bf16"},
}
# mode -> pipeline settings.  Tolerances: max |dlogit| vs the f32 reference, together with all
# tokens equal; device-default has none (it is gated on the ir-default peer, PEER_SLACK), the
# DEFAULT_PARTS are only reported.
# The f32 hint also keeps NPUW's tensors between sub-graphs f32 (runtime/device.py), so the NPU
# path is held to the CPU bound.
MODES: dict[str, dict[str, Any]] = {
    # `auto` KV under the f32 hint is f32 KV, on CPU's default PagedAttention backend too
    "exact": {**EXACT_F32},
    # the static-shape path on CPU (the NPU path always is)
    "sdpa": {"attention_backend": "sdpa", **EXACT_F32},
    "copy": {"kv_precision": "f32", "kv_binding": "copy", **EXACT_F32},
    # static models: with their variants (pyramid prefill, generate variants; the defaults),
    # and with one prefill and one generate model
    "static": {"kv_precision": "f32", "static_models": True, **EXACT_F32},
    "no-pyramid": {
        "kv_precision": "f32",
        "static_models": True,
        "prefill_attention": "static",
        "generate_pyramid": False,
        **EXACT_F32,
    },
    # the full ladders: a prefill model per doubling of the past, a generate model per doubling
    # of the prompt (what prefill_attention="pyramid", generate_pyramid=YES ask for)
    "pyramid": {
        "kv_precision": "f32",
        "static_models": True,
        "prefill_attention": "pyramid",
        "generate_pyramid": True,
        **EXACT_F32,
    },
    "f16-kv": {"kv_precision": "f16", **EXACT_F32},
    # V stored transposed [1, H, D, S] in the static models (NPUW_LLM_OPTIMIZE_V_TENSORS)
    "v-transposed": {"static_models": True, "optimize_v_tensors": True, **EXACT_F32},
    "bf16-kv": {"kv_precision": "bf16", **EXACT_F32},
    "device-default": {},
    **{name: {"attention_backend": "pa", **parts} for name, parts in DEFAULT_PARTS.items()},
}
TOLERANCE: dict[str, dict[str, float]] = {
    "exact": {"CPU": 1e-3, "NPU": 1e-3},
    "sdpa": {"CPU": 1e-3},
    "copy": {"CPU": 1e-3, "NPU": 1e-3},
    "static": {"CPU": 1e-3, "NPU": 1e-3},
    "no-pyramid": {"CPU": 1e-3, "NPU": 1e-3},
    "pyramid": {"CPU": 1e-3, "NPU": 1e-3},
    "v-transposed": {"CPU": 1e-3, "NPU": 1e-3},
    "f16-kv": {"CPU": 0.1, "NPU": 0.1},
    # bf16 keeps 8 mantissa bits to f16's 11: ~8x the rounding of f16-kv (0.22 / 0.45 seen at
    # 1k / 4k; NPUW's own f16 KV gives 0.44 / 0.56).  NPUW has no bf16 (see NOT_ON_DEVICE).
    "bf16-kv": {"CPU": 1.0},
}
# (mode, device) pairs that do not exist, reported as such instead of run
NOT_ON_DEVICE = {
    ("bf16-kv", "NPU"): "n/a: NPUW has no bf16 tensors (f16-kv is the NPU's 16-bit KV)",
    ("sdpa", "NPU"): "n/a: the NPU path is always the static-shape one (see exact)",
    **{(part, "NPU"): "n/a: one part of the CPU's defaults" for part in DEFAULT_PARTS},
}
# device-default computes in the device's own precision (bf16 and int8 dynamic quantization on
# this CPU), so it cannot follow the f32 path token for token.  It is held instead to the
# untouched stateful IR compiled with the same defaults (the ir-default peer): our rewrites may
# not make the error larger than the plugin's own, within these factors (where a greedy path
# first flips is left out: at these errors it is a matter of near-ties).
PEER_SLACK = {"max_abs_dlogit": 1.5, "mean_kl": 1.25}
