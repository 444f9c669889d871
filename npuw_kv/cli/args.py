"""The command line's model and settings arguments, shared by every ``npuw-kv`` command that
loads a model (``bench`` included): choices and defaults come from :mod:`npuw_kv.config`."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from ..config.pipeline_config import PipelineConfig
from ..config.settings import ATTENTION_BACKENDS, EXACT_F32, GGUF_ZERO_POINTS, KV_PRECISIONS

_DEFAULTS = PipelineConfig()


def text_args(parser: argparse.ArgumentParser, new_tokens: int) -> None:
    parser.add_argument(
        "--max-new-tokens",
        "-n",
        type=int,
        default=new_tokens,
        help=f"most tokens to generate (default {new_tokens}; a cut answer is marked on stderr)",
    )
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="> 1 discourages repeating prompt/output tokens (default 1.0, as the API's)",
    )
    parser.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.5,
        help="> 0 discourages tokens by how often the answer used them (default 0.5, the API's "
        "0: the 135M default model loops without it; a repetition penalty instead ends its "
        "answers after a title)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sample at this temperature (default: greedy decoding)",
    )
    parser.add_argument("--top-p", type=float, default=None, help="sampling: nucleus mass")
    parser.add_argument("--top-k", type=int, default=None, help="sampling: the k likeliest")
    parser.add_argument("--seed", type=int, default=None, help="sampling: the random seed")


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The generation fields the text options set: sampling when any sampling option is."""
    given = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "rng_seed": args.seed,
    }
    fields = {k: v for k, v in given.items() if v is not None}
    if fields:
        fields["do_sample"] = True
    penalties = {
        "repetition_penalty": args.repetition_penalty,
        "frequency_penalty": args.frequency_penalty,
    }
    return {**penalties, **fields}


def at_least(low: int, why: str = "", high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low`` (and <= ``high``, when given)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}{why}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high}, got {value}")
        return value

    return parse


def zero_points_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gguf-zero-points",
        choices=GGUF_ZERO_POINTS,
        default=_DEFAULTS.gguf_zero_points,
        help="GGUF only: keep openvino-genai's conversion (genai) or fix its rounded Q4_1 "
        "zero points (exact: SmolLM2 perplexity 14.2 -> 11.6, +24 MB)",
    )


def _setting(text: str) -> str:
    """An argparse type: ``KEY=VALUE``, so a malformed setting is a usage error before any
    work is done."""
    key, sep, _ = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return text


def model_args(parser: argparse.ArgumentParser, for_bench: bool = False) -> None:
    parser.add_argument(
        "--model",
        "-m",
        default=None,
        help="IR directory, .gguf file, 'smollm2' (the default, shipped SmolLM2) or 'gemma3'",
    )
    zero_points_arg(parser)
    if for_bench:  # the runtimes pick their devices; --device only picks which npuw-kv path
        parser.add_argument(
            "--device", "-d", default=None, help="CPU or NPU: the npuw-kv path to bench by default"
        )
    else:
        parser.add_argument(
            "--device",
            "-d",
            default="CPU",
            help="CPU, NPU, or auto: the NPU when this machine has one, else the CPU (default CPU)",
        )
    parser.add_argument(
        "--max-prompt-len",
        type=int,
        default=None,
        help=f"MAX_PROMPT_LEN ({_DEFAULTS.max_prompt_len})",
    )
    parser.add_argument(
        "--min-response-len",
        type=int,
        default=None,
        help=f"MIN_RESPONSE_LEN ({_DEFAULTS.min_response_len})",
    )
    parser.add_argument(
        "--chunk",
        type=int,
        default=None,
        help=f"prefill chunk size ({_DEFAULTS.prefill_chunk_size})",
    )
    parser.add_argument("--kv-precision", choices=KV_PRECISIONS, default=None)
    parser.add_argument(
        "--attention",
        choices=ATTENTION_BACKENDS,
        default=None,
        help="attention_backend: pa (CPU PagedAttention, the CPU default) or sdpa (static shapes)",
    )
    parser.add_argument(
        "--exact",
        action="store_true",
        help="exact f32 compute on CPU (no bf16, no dynamic quantization)",
    )
    parser.add_argument(
        "--prop",
        "-p",
        action="append",
        type=_setting,
        default=[],
        metavar="KEY=VALUE",
        help="extra setting, e.g. -p NPUW_ONLINE_PIPELINE=NONE (repeatable)",
    )


def pipeline_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for name, key in (
        ("max_prompt_len", "max_prompt_len"),
        ("min_response_len", "min_response_len"),
        ("chunk", "prefill_chunk_size"),
        ("kv_precision", "kv_precision"),
        ("attention", "attention_backend"),
    ):
        if getattr(args, name) is not None:
            kwargs[key] = getattr(args, name)
    if args.exact:
        kwargs.update(EXACT_F32)
    flags = {key: value for key, value in kwargs.items() if key not in EXACT_F32}
    for item in args.prop:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--prop expects KEY=VALUE, got {item!r}")
        _check_not_flagged(key, value, flags)
        kwargs[key] = value
    return kwargs


# the flags above that set a pipeline setting of another name
_FLAG_OF = {"prefill_chunk_size": "chunk", "attention_backend": "attention"}


def _check_not_flagged(key: str, value: str, flags: dict[str, Any]) -> None:
    """A ``-p`` setting that a dedicated flag also set, to another value, is refused (the
    library refuses one setting given twice the same way): neither silently wins."""
    from ..config.pipeline_config import PipelineConfig

    name = PipelineConfig.setting_name(key)
    if name in flags and str(flags[name]) != value:
        flag = "--" + _FLAG_OF.get(name, name).replace("_", "-")
        raise ValueError(
            f"-p {key}={value} and {flag} {flags[name]} set {name} twice: give one of them"
        )
