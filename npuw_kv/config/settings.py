"""What each pipeline setting is called and what it takes: our names and the NPUW/genai
aliases that set the same field, the choices and minimums, and how a given value is read.

:class:`~.config.PipelineConfig` checks its fields against these tables, and the CLI offers
the same choices, so a setting's allowed values are written once.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import UsageError
from ..kv.blocks.shares import format_shares, parse_window_shares

DEVICES = ("CPU", "NPU")
KV_PRECISIONS = ("auto", "f32", "f16", "bf16", "u8")
KV_BINDINGS = ("roi", "contiguous", "copy")
ATTENTION_BACKENDS = ("auto", "sdpa", "pa")
PREFILL_ATTENTIONS = ("auto", "static", "pyramid")  # NPUW_LLM_PREFILL_ATTENTION_HINT
GGUF_ZERO_POINTS = ("genai", "exact")
WINDOW_KVS = ("auto", "ring", "full")  # a sliding-window layer's KV on the static-shape path
NPUW_DEVICE = re.compile(r"(NPU|CPU|GPU)(\.\d+)?", re.IGNORECASE)  # what NPUW places on
# set to 1: every NPU-path pipeline runs under the NPU rules double (npu_io_double), as the
# test suite's second pass of its static-path tests does
NPU_IO_DOUBLE_ENV = "NPUW_KV_NPU_IO_DOUBLE"
# the paged path's batched steps: sequences at most, by default
MAX_NUM_SEQS = 16
# tokens per block of the static-shape path's host prefix store (runtime/prefix_store.py)
STORE_BLOCK_TOKENS = 32

# alias (upper case) -> field name
ALIASES: dict[str, str] = {
    "MAX_PROMPT_LEN": "max_prompt_len",
    "NPUW_LLM_MAX_PROMPT_LEN": "max_prompt_len",
    "MIN_RESPONSE_LEN": "min_response_len",
    "NPUW_LLM_MIN_RESPONSE_LEN": "min_response_len",
    "PREFILL_CHUNK_SIZE": "prefill_chunk_size",
    "NPUW_LLM_PREFILL_CHUNK_SIZE": "prefill_chunk_size",
    "KV_CACHE_PRECISION": "kv_precision",
    "KV_PRECISION": "kv_precision",
    "KV_BINDING": "kv_binding",
    "ATTENTION_BACKEND": "attention_backend",
    "GGUF_ZERO_POINTS": "gguf_zero_points",
    "STATIC_MODELS": "static_models",
    "PREFIX_REUSE": "prefix_reuse",
    "PREFIX_CACHE_TOKENS": "prefix_cache_tokens",
    "PREFIX_CACHE_HOST_TOKENS": "prefix_cache_host_tokens",
    "STATE_CHECKPOINT_INTERVAL": "state_checkpoint_interval",
    "KV_WINDOW_SHARES": "kv_window_shares",
    "NPUW_KV_WINDOW_SIZE_SHARES": "kv_window_shares",
    "NPUW_DEVICES": "npuw_devices",
    "NPU_IO_DOUBLE": "npu_io_double",
    "NUM_THREADS": "num_threads",
    "INFERENCE_NUM_THREADS": "num_threads",
    "PREFILL_ATTENTION": "prefill_attention",
    "NPUW_LLM_PREFILL_ATTENTION_HINT": "prefill_attention",
    "GENERATE_PYRAMID": "generate_pyramid",
    "NPUW_LLM_GENERATE_PYRAMID": "generate_pyramid",
    "SHARED_HEAD": "shared_head",
    "NPUW_LLM_SHARED_HEAD": "shared_head",
    "OPTIMIZE_V_TENSORS": "optimize_v_tensors",
    "NPUW_LLM_OPTIMIZE_V_TENSORS": "optimize_v_tensors",
    "WINDOW_KV": "window_kv",
    "MAX_NUM_SEQS": "max_num_seqs",
    "SPLIT_FUSE": "split_fuse",
    "DYNAMIC_SPLIT_FUSE": "split_fuse",
}
# OpenVINO properties passed through to compile_model unchanged (the plugin validates values).
PASSTHROUGH = (
    "INFERENCE_PRECISION_HINT",
    "DYNAMIC_QUANTIZATION_GROUP_SIZE",
    "CACHE_DIR",
    "SNIPPETS_MODE",
    "CPU_RUNTIME_CACHE_CAPACITY",
)
PASSTHROUGH_PREFIXES = ("NPUW_", "NPU_")

# NPUW's own LLM pipeline's MoE hints: how it runs a mixture of experts per phase
MOE_HINTS = ("NPUW_LLM_PREFILL_MOE_HINT", "NPUW_LLM_GENERATE_MOE_HINT")
MOE_HINT_VALUES = ("DENSE", "HOST_ROUTED", "DEVICE_ROUTED")


def npuw_llm_option(key: str, value: Any) -> None:
    """An option of NPUW's own LLM pipeline that no setting here maps (npuw-kv replaces that
    pipeline, and the NPU plugin refuses its options elsewhere, at compile time): a MoE hint
    of DENSE is how npuw-kv runs experts anyway; any other is refused by name, now."""
    if key in MOE_HINTS:
        hint = str(value).strip().upper()
        if hint not in MOE_HINT_VALUES:
            raise UsageError(f"{key}={value!r}: NPUW's MoE hints are {', '.join(MOE_HINT_VALUES)}")
        if hint != "DENSE":
            raise UsageError(
                f"{key}={hint}: npuw-kv runs a mixture of experts as its graph has it (every "
                f"expert in the static models: DENSE); NPUW's LLM pipeline's {hint} rewrite is "
                "not done here: leave it unset or DENSE"
            )
        return
    mapped = sorted(k for k in ALIASES if k.startswith("NPUW_LLM_"))
    raise UsageError(
        f"{key} is an option of NPUW's own LLM pipeline, which npuw-kv replaces; the ones it "
        f"takes: {', '.join(mapped)} (and {', '.join(MOE_HINTS)}=DENSE)"
    )


EXACT_F32 = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}
"""CPU properties for an exact f32 run (the CPU plugin otherwise may use bf16 compute and
int8 dynamic quantization of activations for compressed weights)."""


_INTS = (
    "max_prompt_len",
    "min_response_len",
    "prefill_chunk_size",
    "num_threads",
    "prefix_cache_tokens",
    "prefix_cache_host_tokens",
    "state_checkpoint_interval",
    "max_num_seqs",
)
# None means auto for these
_AUTO_BOOLS = ("static_models", "generate_pyramid", "shared_head", "optimize_v_tensors")
_BOOLS = ("prefix_reuse", "full_prefill_logits", "split_fuse", "npu_io_double", *_AUTO_BOOLS)
_LOWER = (
    "kv_precision",
    "kv_binding",
    "gguf_zero_points",
    "attention_backend",
    "prefill_attention",
    "window_kv",
)
# the smallest value of each size, and the values each choice allows
MINIMUMS = {
    "prefill_chunk_size": 1,
    "max_prompt_len": 1,
    "min_response_len": 1,
    "prefix_cache_tokens": 0,
    "prefix_cache_host_tokens": 0,
    "state_checkpoint_interval": 0,
    "num_threads": 0,
    "max_num_seqs": 1,
}
CHOICES = {
    "kv_precision": KV_PRECISIONS,
    "kv_binding": KV_BINDINGS,
    "attention_backend": ATTENTION_BACKENDS,
    "prefill_attention": PREFILL_ATTENTIONS,
    "gguf_zero_points": GGUF_ZERO_POINTS,
    "window_kv": WINDOW_KVS,
}


def label(name: str) -> str:
    """A setting's name as messages give it: the field and every alias that sets it."""
    aliases = [alias for alias, field_name in ALIASES.items() if field_name == name]
    return f"{name} ({' / '.join(aliases)})" if aliases else name


def _as_bool(key: str, value: Any) -> bool:
    """True/False, or the YES/NO strings OpenVINO properties use (not None, not other types)."""
    if isinstance(value, bool):
        return value
    text = value.strip().upper() if isinstance(value, str) else None
    if text in ("YES", "TRUE", "1", "ON"):
        return True
    if text in ("NO", "FALSE", "0", "OFF"):
        return False
    raise UsageError(f"{key}={value!r}: expected True/False or YES/NO")


def _as_int(key: str, value: Any) -> int:
    if isinstance(value, bool):  # an int subclass, but never meant as a size
        raise UsageError(f"{key}={value!r}: expected an integer")
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise UsageError(f"{key}={value!r}: expected an integer") from None
    if isinstance(value, float) and value != number:
        raise UsageError(f"{key}={value!r}: expected an integer")
    return number


def normalize(name: str, value: Any) -> Any:
    """A setting's value in its field's type, so that two spellings of it compare equal."""
    if name in _INTS:
        return _as_int(name, value)
    if name in _BOOLS and not (name in _AUTO_BOOLS and value is None):
        return _as_bool(name, value)
    if name in _LOWER:  # an ov.Type (as genai's users write kv_cache_precision) by its name
        get = getattr(value, "get_type_name", None)
        return (get() if callable(get) else str(value)).lower()
    if name == "kv_window_shares" and value is not None:  # canonical text, checked
        return format_shares(parse_window_shares(value, label(name)))
    return value
