"""OpenAI's request bodies read into one pipeline call, every field checked.

Each field of ``/v1/chat/completions`` and ``/v1/completions`` is either honoured or refused
by name with OpenAI's error shape (HTTP 400, ``{"error": {"message", "type", "param"}}``); none
is dropped silently.  Sampling fields the request leaves out take the model's generation config
(as vLLM does), so a bare request decodes greedily like ``npuw-kv generate``; a ``temperature``
of 0 is greedy, above 0 samples.  A few fields vLLM also takes are honoured beside OpenAI's:
``top_k``, ``min_p``, ``repetition_penalty`` and ``ignore_eos``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from .api_error import ApiError, bad
from .chat_messages import read_messages
from .tools import ChatFormat, ToolRequest, read_tool_request

MAX_CHOICES = 16  # ``n``: more answers per request than this is refused
MAX_TOKENS = 2**63 - 1  # what a generation config's max_new_tokens holds
MAX_STOPS = 32  # stop strings per request (OpenAI takes 4, vLLM has no limit; lm-eval sends 5+)
MAX_TOP_LOGPROBS = 20  # chat's ``top_logprobs``, as OpenAI
MAX_COMPLETION_LOGPROBS = 5  # completions' ``logprobs``, as OpenAI

# OpenAI fields with no meaning here: refused with the reason
_REFUSED = {
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "logit_bias": "logit_bias is not supported",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "suffix": "suffix (insertion) is not supported",
    "reasoning_effort": "reasoning_effort is not supported",
    "web_search_options": "web search is not supported",
}
# fields that have no effect on the answer in OpenAI's API either (identifiers, storage)
_NO_EFFECT = {"user", "store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key"}
_SAMPLING = ("top_p", "top_k", "min_p")
_COMMON = {
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n", "seed",
    "stop", "presence_penalty", "frequency_penalty", "top_k", "min_p", "repetition_penalty",
    "ignore_eos", "logprobs",
}  # fmt: skip
_CHAT = _COMMON | {
    "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice",
    "parallel_tool_calls",
}  # fmt: skip
_COMPLETION = _COMMON | {"prompt", "echo", "best_of"}


@dataclass
class Job:
    """One request as one pipeline call: ``inputs`` (a chat's messages, or completion
    prompts), the generation fields, and how the answer is to be shaped."""

    chat: bool
    # chat: a list of {"role", "content"}; completions: a str, a list of them, or token-id
    # prompts as genai's TokenizedInputs (one row each, right-padded, with its attention mask)
    inputs: Any
    prompts: int  # how many prompts ``inputs`` holds
    config: dict[str, Any] = field(default_factory=dict)  # GenerationConfig fields
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    top_logprobs: int | None = None  # None: no logprobs; else how many alternatives per token
    echo_logprobs: bool = False  # echo with logprobs: the prompt's tokens scored too
    model: str = ""
    tools: ToolRequest | None = None  # a chat's tools (and how they may be used)
    format: ChatFormat | None = None  # how the served model's template writes calls and thoughts

    @property
    def answers(self) -> int:
        return self.prompts * self.n


def read_body(raw: bytes) -> dict[str, Any]:
    """The request's JSON object, or a 400 saying what is wrong with it."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def chat_job(
    body: dict[str, Any], models: tuple[str, ...], chat_format: ChatFormat | None = None
) -> Job:
    """A ``/v1/chat/completions`` body as a :class:`Job`; ``chat_format``: what the served
    model's chat template does with tools (none: tools go to the template as given)."""
    _check_fields(body, _CHAT)
    messages = read_messages(body.get("messages"))
    chat_format = chat_format or ChatFormat()
    tools = read_tool_request(body)
    job = Job(True, chat_format.chat_inputs(messages, tools), 1, tools=tools, format=chat_format)
    _common(job, body, models)
    max_tokens = _opt_int(body, "max_completion_tokens", 1, MAX_TOKENS)
    if max_tokens is not None:
        job.config["max_new_tokens"] = max_tokens
    top = _opt_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if _opt_bool(body, "logprobs"):
        _want_logprobs(job, top or 0)
    elif top is not None:
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    fmt = _response_format(body.get("response_format"))
    if tools is not None and tools.constrained:
        if fmt is not None:
            raise bad("response_format", "response_format cannot be combined with tool_choice "
                      f"{tools.choice!r}: the answer is then the tool call's JSON")  # fmt: skip
        import openvino_genai

        fmt = openvino_genai.StructuredOutputConfig(json_schema=json.dumps(tools.schema()))
    if fmt is not None:
        job.config["structured_output_config"] = fmt
    return job


def completion_job(body: dict[str, Any], models: tuple[str, ...]) -> Job:
    """A ``/v1/completions`` body as a :class:`Job`."""
    _check_fields(body, _COMPLETION)
    prompt = body.get("prompt")
    job = Job(False, *_prompts(prompt))
    _common(job, body, models)
    job.config["apply_chat_template"] = False
    top = _opt_int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    if top is not None:
        _want_logprobs(job, top)
    if _opt_bool(body, "echo"):
        job.config["echo"] = True
        # the prompt's own log-probabilities (genai's echo with logprobs): what lm-eval scores
        job.echo_logprobs = top is not None
    best_of = _opt_int(body, "best_of", 1)
    if best_of is not None and best_of != job.n:
        raise bad("best_of", f"best_of must equal n ({job.n}): ranking extra answers is not done")
    return job


def _prompts(prompt: Any) -> tuple[Any, int]:
    """A completion's ``prompt`` as the pipeline's input and how many prompts it holds: a
    string, a list of strings, one prompt's token ids, or a list of them (as OpenAI and
    vLLM take them); none empty, at most MAX_CHOICES."""
    if isinstance(prompt, str):
        texts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        texts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt):
        texts = [prompt]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, list) and all(_is_id(t) for t in p) for p in prompt)
    ):
        texts = list(prompt)
    else:
        raise bad("prompt", "prompt must be a string, a non-empty list of strings, a list of "
                  "token ids (integers), or a list of such lists")  # fmt: skip
    if len(texts) > MAX_CHOICES:
        raise bad("prompt", f"at most {MAX_CHOICES} prompts per request, got {len(texts)}")
    empty = [i for i, text in enumerate(texts) if not text]
    if empty:  # a completion continues text: an empty one has nothing to continue
        where = "prompt" if isinstance(prompt, str) or texts[0] is prompt else f"prompt[{empty[0]}]"
        raise bad(where, f"{where} is empty: give the text (or token ids) to continue")
    if isinstance(texts[0], str):
        return (prompt if isinstance(prompt, str) else texts), len(texts)
    return _token_rows(texts), len(texts)


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_rows(rows: list[list[int]]) -> Any:
    """Token-id prompts as genai's ``TokenizedInputs``: one right-padded row each, its
    attention mask marking its tokens (ids outside the vocabulary are the pipeline's 400)."""
    import numpy as np
    import openvino as ov
    import openvino_genai

    width = max(len(row) for row in rows)
    ids = np.zeros((len(rows), width), np.int64)
    mask = np.zeros((len(rows), width), np.int64)
    for i, row in enumerate(rows):
        if any(not -(2**63) <= t < 2**63 for t in row):
            raise bad("prompt", "a token id in prompt is outside the vocabulary")
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return openvino_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(mask))


def _want_logprobs(job: Job, top: int) -> None:
    """Each token's log-probability under the model (before penalties and sampling filters,
    as genai reports it) and ``top`` alternatives."""
    job.top_logprobs = top
    job.config["logprobs"] = max(top, 1)


# -- the fields both endpoints take -----------------------------------------------------------
def _check_fields(body: dict[str, Any], known: set[str]) -> None:
    for name, value in body.items():
        if name in known or name in _NO_EFFECT or value is None:
            continue
        if name in _REFUSED and value not in ([], {}, False, ""):
            raise bad(name, f"{name}: {_REFUSED[name]}")
        if name not in _REFUSED:
            raise bad(name, f"unsupported field {name!r}")


def _common(job: Job, body: dict[str, Any], models: tuple[str, ...]) -> None:
    model = body.get("model")
    if not isinstance(model, str):
        raise bad("model", "model is required: a string (GET /v1/models lists them)")
    if model not in models:
        raise ApiError(
            404, f"model {model!r} is not served here; serving {', '.join(models)}", "model",
            code="model_not_found",
        )  # fmt: skip
    job.model = model
    cfg = job.config
    job.stream = bool(_opt_bool(body, "stream"))
    options = body.get("stream_options")
    if options is not None:
        if not job.stream:
            raise bad("stream_options", "stream_options is only allowed with stream: true")
        if not isinstance(options, dict):
            raise bad("stream_options", "stream_options must be an object")
        for key in options:  # OpenAI's keys and vLLM's continuous_usage_stats
            if key not in ("include_usage", "continuous_usage_stats", "include_obfuscation"):
                raise bad(f"stream_options.{key}", f"unsupported field stream_options.{key}")
            _opt_bool(options, key, "stream_options.")
        job.include_usage = bool(options.get("include_usage"))
    job.n = _opt_int(body, "n", 1, MAX_CHOICES) or 1
    cfg["num_return_sequences"] = job.n
    max_tokens = _opt_int(body, "max_tokens", 0, MAX_TOKENS)
    if max_tokens == 0 and (job.chat or body.get("echo") is not True):
        # as genai, vLLM and OpenAI: no new token is only a prompt scored with echo
        raise bad("max_tokens", "max_tokens must be >= 1 (0 only on /v1/completions with "
                  "echo: true, which scores the prompt without generating)")  # fmt: skip
    if max_tokens is not None:
        cfg["max_new_tokens"] = max_tokens
    temperature = _opt_float(body, "temperature", 0.0, 2.0)
    samples = job.n > 1 or any(body.get(k) is not None for k in _SAMPLING)
    if temperature is None and samples:
        temperature = 1.0  # OpenAI's default temperature, when the request samples
    if temperature is not None:
        cfg["do_sample"] = temperature > 0
        if temperature > 0:
            cfg["temperature"] = temperature
    for name, low, high, open_low in (
        ("top_p", 0.0, 1.0, True),
        ("min_p", 0.0, 1.0, False),
        ("presence_penalty", -2.0, 2.0, False),
        ("frequency_penalty", -2.0, 2.0, False),
        ("repetition_penalty", 0.0, 10.0, True),
    ):
        value = _opt_float(body, name, low, high, open_low)
        if value is not None:
            cfg[name] = value
    top_k = _opt_int(body, "top_k", 0)
    if top_k is not None:
        cfg["top_k"] = top_k
    seed = _opt_int(body, "seed", -(2**63), 2**63 - 1)
    if seed is not None:
        cfg["rng_seed"] = seed % 2**64  # genai's seed is unsigned; the same seed, the same run
    if _opt_bool(body, "ignore_eos"):
        cfg["ignore_eos"] = True
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if (
            not isinstance(stops, list)
            or len(stops) > MAX_STOPS
            or not all(isinstance(s, str) and s for s in stops)
        ):
            raise bad("stop", f"stop must be a non-empty string or a list of at most {MAX_STOPS} "
                      "of them")  # fmt: skip
        if stops:
            cfg["stop_strings"] = set(stops)


def _response_format(value: Any) -> Any:
    """``response_format`` as genai's ``StructuredOutputConfig`` (None for plain text)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad("response_format.json_schema.schema", "a JSON schema object is required")
    else:
        raise bad("response_format", "response_format.type must be text, json_object or "
                  "json_schema")  # fmt: skip
    import openvino_genai

    return openvino_genai.StructuredOutputConfig(json_schema=json.dumps(schema))


# -- typed values -----------------------------------------------------------------------------
def _opt_bool(body: dict[str, Any], name: str, prefix: str = "") -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad(prefix + name, f"{prefix}{name} must be true or false, got {value!r}")
    return value


def _opt_int(
    body: dict[str, Any], name: str, low: int | None = None, high: int | None = None
) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad(name, f"{name} must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise bad(name, f"{name} must be {span}, got {value}")
    return value


def _opt_float(
    body: dict[str, Any], name: str, low: float, high: float, open_low: bool = False
) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise bad(name, f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value > high or value < low or (open_low and value == low):
        span = f"({low}, {high}]" if open_low else f"[{low}, {high}]"
        raise bad(name, f"{name} must be in {span}, got {value}")
    return value
