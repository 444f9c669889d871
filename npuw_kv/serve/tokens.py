"""vLLM's ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info`` and ``GET /version``:
the model's tokenizer over HTTP, for clients that count or cut prompts before sending them
(lm-eval's ``tokenizer_backend=remote`` tokenizes with these, so it needs no local copy).

``/tokenize`` takes a ``prompt`` (raw text; ``add_special_tokens`` defaults to true) or chat
``messages`` (through the chat template; ``add_generation_prompt`` defaults to true,
``add_special_tokens`` to false), and answers ``{"count", "max_model_len", "tokens",
"token_strs"}`` (``token_strs`` with ``return_token_strs``).  ``/detokenize`` takes ``tokens``
and answers ``{"prompt"}``.  Other fields are refused by name.
"""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .. import __version__
from .protocol import ApiError, bad, chat_job, read_body

_TOKENIZE = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
             "return_token_strs"}  # fmt: skip


class TokenRoutes:
    """The three routes over one pipeline's tokenizer."""

    def __init__(self, pipe: Any, models: tuple[str, ...]) -> None:
        self.tokenizer = pipe.get_tokenizer()
        self.models = models
        self.max_model_len = int(pipe.config.total_len)
        self.vocab = int(pipe.vocab_size)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": __version__})

    async def tokenizer_info(self, request: Request) -> Response:
        """The special tokens, the chat template and the length limit (vLLM's fields)."""
        tok = self.tokenizer

        def text(get: Any) -> str | None:
            return str(get()) or None

        return JSONResponse({
            "tokenizer_class": "openvino_tokenizers",
            "bos_token": text(tok.get_bos_token),
            "eos_token": text(tok.get_eos_token),
            "pad_token": text(tok.get_pad_token),
            "chat_template": str(tok.chat_template or "") or None,
            "model_max_length": self.max_model_len,
            "vocab_size": self.vocab,
        })  # fmt: skip

    async def tokenize(self, request: Request) -> Response:
        body = read_body(await request.body())
        self._check(body, _TOKENIZE)
        ids = await run_in_threadpool(self._encode, body)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.max_model_len,
                               "tokens": ids, "token_strs": None}  # fmt: skip
        if _flag(body, "return_token_strs", False):
            out["token_strs"] = list(self.tokenizer.decode([[t] for t in ids],
                                                           skip_special_tokens=False))  # fmt: skip
        return JSONResponse(out)

    async def detokenize(self, request: Request) -> Response:
        body = read_body(await request.body())
        self._check(body, {"model", "tokens"})
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab for t in ids
        ):
            raise bad("tokens", f"tokens must be a list of token ids in [0, {self.vocab})")
        text = await run_in_threadpool(self.tokenizer.decode, ids) if ids else ""
        return JSONResponse({"prompt": text})

    def _check(self, body: dict[str, Any], known: set[str]) -> None:
        for name in body:
            if name not in known:
                raise bad(name, f"unsupported field {name!r}")
        model = body.get("model")
        if model is not None and model not in self.models:
            served = ", ".join(self.models)
            raise ApiError(404, f"model {model!r} is not served here; serving {served}",
                           "model", code="model_not_found")  # fmt: skip

    def _encode(self, body: dict[str, Any]) -> list[int]:
        prompt, messages = body.get("prompt"), body.get("messages")
        if (prompt is None) == (messages is None):
            raise bad("prompt", "give either prompt (text) or messages (a chat)")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise bad("prompt", "prompt must be a string")
            if "add_generation_prompt" in body:
                raise bad("add_generation_prompt", "add_generation_prompt goes with messages")
            return self._ids(prompt, _flag(body, "add_special_tokens", True))
        # the chat's messages read as /v1/chat/completions reads them
        job = chat_job({"model": self.models[0], "messages": messages}, self.models)
        try:
            text = self.tokenizer.apply_chat_template(
                job.inputs, add_generation_prompt=_flag(body, "add_generation_prompt", True)
            )
        except RuntimeError as exc:
            raise bad("messages", f"the chat template failed: {exc}") from None
        return self._ids(text, _flag(body, "add_special_tokens", False))

    def _ids(self, text: str, special: bool) -> list[int]:
        try:
            encoded = self.tokenizer.encode(text, add_special_tokens=special)
        except (RuntimeError, TypeError) as exc:
            raise bad("prompt", f"the tokenizer could not take this text: {exc}") from None
        return [int(t) for t in encoded.input_ids.data.reshape(-1)]


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, f"{name} must be true or false, got {value!r}")
    return value
