"""Pipeline settings: one validated dataclass, accepting our names and NPUW's.

Keys are case-insensitive.  Both ``max_prompt_len`` and ``MAX_PROMPT_LEN`` /
``NPUW_LLM_MAX_PROMPT_LEN`` set the same field, so configurations written for NPUW or
openvino-genai's NPU pipeline work unchanged.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import UsageError
from ..kv.blocks.shares import format_shares, parse_window_shares
from . import decide
from .settings import (
    ALIASES,
    CHOICES,
    DEVICES,
    MAX_NUM_SEQS,
    MINIMUMS,
    NPU_IO_DOUBLE_ENV,
    NPUW_DEVICE,
    PASSTHROUGH,
    PASSTHROUGH_PREFIXES,
    STORE_BLOCK_TOKENS,
    label,
    normalize,
    npuw_llm_option,
)


@dataclass(frozen=True)
class PipelineConfig:
    """Static shapes and runtime choices of one pipeline.

    ``max_prompt_len`` is rounded up to a multiple of ``prefill_chunk_size`` (as NPUW does) so
    every chunk is full; ``total_len`` = max_prompt_len + min_response_len is the KV capacity.
    ``static_models``: None picks per device — CPU compiles one model with dynamic sequence dims
    that serves both the prefill and generate shapes (weights held once); NPU needs (and gets)
    two static models.
    """

    device: str = "CPU"
    max_prompt_len: int = 1024
    min_response_len: int = 128
    prefill_chunk_size: int = 256
    kv_precision: str = "auto"
    # "roi": every KV tensor a view of the shared buffer, strided ones too; "contiguous": only
    # dense views bound, strided ones staged (a device refusing strides); "copy": all staged
    kv_binding: str = "roi"
    static_models: bool | None = None
    attention_backend: str = "auto"  # "pa": PagedAttention (CPU); "sdpa": static-shape views
    prefix_reuse: bool = True  # a prompt that starts like the cached tokens runs only the rest
    # paged path: KV room beyond one sequence's, where earlier prompts' blocks stay cached
    prefix_cache_tokens: int = 0
    # paged path: a host-memory tier of the prefix cache (tokens), where evicted blocks go;
    # and the shares of the prefix-cache room and host tier between window pools
    # ("0.25,0.75": ascending windows, full last; "8:0.25,full:0.75"; None: same tokens each)
    prefix_cache_host_tokens: int = 0
    kv_window_shares: str | None = None
    # paged path, hybrid models: tokens between checkpoints of the linear-attention states
    # (whole KV blocks; 0: the prefill chunk rounded up to them)
    state_checkpoint_interval: int = 0
    npuw_devices: str = "CPU"
    # NPU path on NPUW's CPU stand-in: run the requests under a double of the NPU plugin's I/O
    # rules (runtime/npu_rules.py): what a real NPU refuses fails, what it copies is counted
    npu_io_double: bool = False
    num_threads: int = 0
    full_prefill_logits: bool = False  # LM head on every prefill row (perplexity checks only)
    # static models (NPU): prefill variants by past length and generate variants by KV
    # length ("auto" / None: the lean ladders, see StaticShapes), the embedding and LM head cut
    # out and compiled once (None: on where the graph allows), V stored transposed
    # [1, H, D, S] (None: see ``v_transposed``)
    prefill_attention: str = "auto"
    generate_pyramid: bool | None = None
    shared_head: bool | None = None
    optimize_v_tensors: bool | None = None
    # static-shape path: a sliding-window layer's KV in a ring of window + one chunk of slots
    # ("auto": unless the host prefix store needs every layer's whole past) or "full" length
    window_kv: str = "auto"
    # paged path: sequences run together in one batched step at most (several prompts, or
    # num_return_sequences); the others wait for room
    max_num_seqs: int = MAX_NUM_SEQS
    # paged batches: a step may run decode tokens and prompt chunks together (genai's
    # dynamic_split_fuse); False: prompt chunks first, in steps of their own
    split_fuse: bool = True
    gguf_zero_points: str = "genai"  # "exact": fix openvino-genai's rounded Q4_1 zero points
    compile_properties: dict[str, Any] = field(default_factory=dict)
    # max_prompt_len as given, before rounding up to a multiple of the chunk (for messages)
    requested_max_prompt_len: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        device = str(self.device).upper()
        object.__setattr__(self, "device", device)
        if device not in DEVICES:
            raise UsageError(f"unknown device {self.device!r}; choose one of {', '.join(DEVICES)}")
        for name, minimum in MINIMUMS.items():
            if getattr(self, name) < minimum:
                raise UsageError(f"{label(name)} must be >= {minimum}, got {getattr(self, name)}")
        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                raise UsageError(f"{label(name)} {getattr(self, name)!r} not in {choices}")
        if self.kv_precision == "bf16" and device == "NPU":  # NPUW has no bf16 tensors
            raise UsageError(
                f"{label('kv_precision')} 'bf16' is not supported on NPU: NPUW feeds its "
                "sub-models f16 instead; use 'f16' (the same memory) or 'f32'"
            )
        self._check_attention_backend()
        self._check_variants()
        self._check_tiers()
        room = self.prefix_cache_tokens
        if room and not self.paged and room < STORE_BLOCK_TOKENS:
            raise UsageError(
                f"{label('prefix_cache_tokens')} on the static-shape path is a host store"
                f" of whole blocks of {STORE_BLOCK_TOKENS} tokens: give 0 or at least "
                f"{STORE_BLOCK_TOKENS}, got {self.prefix_cache_tokens}"
            )
        if self.window_kv == "ring" and room and not self.paged:
            raise UsageError(
                f"{label('window_kv')} 'ring' keeps only a window of each sliding-window layer, "
                f"but {label('prefix_cache_tokens')} on the static-shape path stores every "
                "layer's whole past: set window_kv='full', prefix_cache_tokens=0, or use "
                "attention_backend='pa'"
            )
        if not isinstance(self.npuw_devices, str) or not all(
            NPUW_DEVICE.fullmatch(d.strip()) for d in self.npuw_devices.split(",")
        ):
            raise UsageError(
                f"{label('npuw_devices')} must be a list of NPU, CPU or GPU devices such as "
                f"'CPU' or 'NPU,CPU', got {self.npuw_devices!r}"
            )
        if device == "NPU" and os.environ.get(NPU_IO_DOUBLE_ENV, "").strip() == "1":
            object.__setattr__(self, "npu_io_double", True)  # the test suite's second pass
        if self.npu_io_double and device != "NPU":
            raise UsageError(
                f"{label('npu_io_double')} stands in for an NPU's I/O rules on the NPU path; "
                f"device is {device}: use device='NPU' or drop it"
            )
        chunk = self.prefill_chunk_size
        rounded = -(-self.max_prompt_len // chunk) * chunk
        object.__setattr__(self, "requested_max_prompt_len", self.max_prompt_len)
        object.__setattr__(self, "max_prompt_len", rounded)

    @property
    def total_len(self) -> int:
        """KV capacity in tokens (MAX_PROMPT_LEN + MIN_RESPONSE_LEN)."""
        return self.max_prompt_len + self.min_response_len

    def kv_capacity(self, context: tuple[int, str] | None) -> int:
        """KV slots: MAX_PROMPT_LEN + MIN_RESPONSE_LEN, within the model's trained context.

        ``context`` is (positions, where that was read) or None when unknown.  A MAX_PROMPT_LEN
        beyond it is refused.  Generation stops at the context, and a prompt's first token sits
        at most ``chunk - 1`` slots in (front padding), so slots past ``context + chunk - 1``
        would never be used: the capacity is capped there, with a warning.
        """
        if not context:
            return self.total_len
        length, where = context
        if self.max_prompt_len > length:
            asked, chunk = self.requested_max_prompt_len, self.prefill_chunk_size
            rounded = (
                f" ({asked} rounded up to a multiple of the chunk, {chunk})"
                if asked != self.max_prompt_len
                else ""
            )
            fits = length // chunk * chunk  # the longest MAX_PROMPT_LEN this chunk allows
            advice = (
                f"lower max_prompt_len (MAX_PROMPT_LEN / NPUW_LLM_MAX_PROMPT_LEN) to at most "
                f"{fits}" + (" or use a smaller prefill_chunk_size" if rounded else "")
                if fits
                else f"lower prefill_chunk_size (NPUW_LLM_PREFILL_CHUNK_SIZE) to at most {length}"
            )
            raise UsageError(
                f"MAX_PROMPT_LEN {self.max_prompt_len}{rounded} is beyond the model's trained "
                f"context of {length} positions ({where}); {advice}"
            )
        usable = length + self.prefill_chunk_size - 1
        if self.total_len > usable:
            warnings.warn(
                f"MAX_PROMPT_LEN {self.max_prompt_len} + MIN_RESPONSE_LEN "
                f"{self.min_response_len} goes beyond the model's trained context of {length} "
                f"positions ({where}), where generation stops anyway: the KV capacity is "
                f"capped at {usable} (the context plus the prefill chunk's padding)",
                RuntimeWarning,
                stacklevel=3,
            )
        return min(self.total_len, usable)

    def _check_attention_backend(self) -> None:
        if self.attention_backend == "pa":
            sdpa_only = {
                "device NPU (NPUW runs static models)": self.device == "NPU",
                "static_models=True": self.static_models is True,
                "kv_binding='copy'": self.kv_binding == "copy",
                "kv_binding='contiguous'": self.kv_binding == "contiguous",
            }
            clash = [what for what, bad in sdpa_only.items() if bad]
            if clash:
                raise UsageError(
                    f"{label('attention_backend')} 'pa' runs on CPU only, with one "
                    f"dynamic model and no views to bind; not with {', '.join(clash)}: "
                    "use attention_backend='sdpa'"
                )
        elif self.kv_precision == "u8" and not self.paged:
            raise UsageError(
                f"{label('kv_precision')} 'u8' needs {label('attention_backend')} 'pa' on CPU "
                "(the device quantises the cache blocks there)"
            )

    def _check_tiers(self) -> None:
        """The block manager's tiers: checked here, honoured on PagedAttention only."""
        if self.kv_window_shares is not None:
            shares = parse_window_shares(self.kv_window_shares, label("kv_window_shares"))
            object.__setattr__(self, "kv_window_shares", format_shares(shares))
        if self.paged:
            return
        if self.state_checkpoint_interval:
            raise UsageError(
                f"{label('state_checkpoint_interval')} applies to attention_backend='pa' (a "
                "hybrid model's states beside the KV blocks); the static-shape path (NPU, "
                "attention_backend='sdpa') runs no hybrid model: leave it unset"
            )
        if self.prefix_cache_host_tokens:
            raise UsageError(
                f"{label('prefix_cache_host_tokens')} applies to attention_backend='pa' (the "
                "block manager's host tier); the static-shape path (NPU, attention_backend="
                "'sdpa') keeps its prefix store on the host already: use prefix_cache_tokens"
            )
        if not self.split_fuse:
            raise UsageError(
                f"{label('split_fuse')} NO schedules the paged path's batched steps; the "
                "static-shape path (NPU, attention_backend='sdpa') runs one sequence at a time: "
                "leave it unset"
            )
        if self.max_num_seqs != MAX_NUM_SEQS and not decide.static_models(self):
            raise UsageError(
                f"{label('max_num_seqs')} applies where several sequences run at once: "
                "attention_backend='pa', or the static models of the NPU path (packed generate "
                "models); the CPU's static-shape path (attention_backend='sdpa') runs one "
                "sequence at a time: leave it unset"
            )
        if self.optimize_v_tensors and self.max_num_seqs not in (1, MAX_NUM_SEQS):
            raise UsageError(
                f"{label('optimize_v_tensors')} YES stores V transposed, which the packed "
                f"generate models do not read; set {label('max_num_seqs')} 1 (one sequence at "
                "a time) or leave optimize_v_tensors unset"
            )
        if self.kv_window_shares is not None:
            raise UsageError(
                f"{label('kv_window_shares')} applies to attention_backend='pa', where the "
                "block manager sizes one pool per window; the static-shape path (NPU, "
                "attention_backend='sdpa') has no window pools: leave it unset"
            )

    def _check_variants(self) -> None:
        """NPUW's LLM options that shape the static models: honoured there, refused where
        they would mean nothing."""
        if self.use_static_models:
            return
        where = "the CPU static-shape path's one dynamic model"
        if self.paged:
            where = "PagedAttention"
        if self.optimize_v_tensors:
            raise UsageError(
                f"{label('optimize_v_tensors')} YES stores V transposed ([1, H, D, S]) in the "
                f"static models (device NPU or static_models=True); {where} keeps V as "
                "[1, H, S, D]. Leave it unset, set it NO, or use static_models=True"
            )
        if self.prefill_attention == "static":
            raise UsageError(
                f"{label('prefill_attention')} 'static' shapes the static models (device NPU "
                f"or static_models=True); {where} runs every chunk over exactly the past "
                "before it"
            )
        if self.prefill_attention == "pyramid":
            warnings.warn(
                f"{label('prefill_attention')} 'pyramid' shapes the static models (device NPU "
                f"or static_models=True); {where} already runs every chunk over exactly the "
                "past before it, as pyramid does: the setting changes nothing here",
                RuntimeWarning,
                stacklevel=4,
            )
        if self.generate_pyramid and not self.paged:
            raise UsageError(
                f"{label('generate_pyramid')} YES shapes the static models (device NPU or "
                f"static_models=True); {where} reads the whole buffer at each step"
            )

    @property
    def paged(self) -> bool:
        """PagedAttention (CPU) or the static-shape path (:func:`.decide.paged`)."""
        return decide.paged(self)

    @property
    def use_static_models(self) -> bool:
        """Static models per phase (:func:`.decide.static_models`)."""
        return decide.static_models(self)

    @classmethod
    def setting_name(cls, key: str) -> str | None:
        """The field ``key`` sets (our name or an NPUW alias, any case), or None for an OpenVINO
        property passed through to ``compile_model``; unknown keys are errors."""
        known = {f.name for f in fields(cls) if f.init} - {"device", "compile_properties"}
        upper = key.upper()
        if upper not in ALIASES and (
            upper in PASSTHROUGH or upper.startswith(PASSTHROUGH_PREFIXES)
        ):
            return None
        name = key if key in known else ALIASES.get(upper, key.lower())
        if name not in known:
            raise UsageError(
                f"unknown setting {key!r}; known: {sorted(known)}, their NPUW names "
                f"{sorted(ALIASES)}, or OpenVINO properties {list(PASSTHROUGH)} / NPUW_*"
            )
        return name

    @classmethod
    def from_kwargs(cls, device: str = "CPU", **kwargs: Any) -> PipelineConfig:
        """Build from our field names or NPUW/genai property names; unknown keys are errors."""
        values: dict[str, Any] = {"device": device}
        given: dict[str, str] = {}  # field -> the key that set it, to catch two aliases
        passthrough: dict[str, Any] = dict(kwargs.pop("compile_properties", None) or {})
        for key, value in kwargs.items():
            name = cls.setting_name(key)
            if name is None and key.upper().startswith("NPUW_LLM_"):
                npuw_llm_option(key.upper(), value)  # refused, or DENSE: what is done anyway
                continue
            if name is None:
                passthrough[key.upper()] = value
                continue
            value = normalize(name, value)
            if name in given and values[name] != value:
                raise UsageError(
                    f"{given[name]}={values[name]!r} and {key}={value!r} set the same setting "
                    f"({name}) to different values; pass one of them"
                )
            values[name], given[name] = value, key
        return cls(**values, compile_properties=passthrough)
