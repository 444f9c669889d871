"""Pipeline results in OpenAI's response shapes: whole answers, stream chunks, log-probabilities
and usage counts."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from .protocol import Job
from .tool_text import AnswerShape

FINISH = {"stop": "stop", "length": "length", "cancelled": "stop", "tool_call": "tool_calls"}


def new_id(job: Job) -> str:
    return ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex


class Reply:
    """The pieces every response and chunk of one request share."""

    def __init__(self, job: Job, tokenizer: Any) -> None:
        self.job, self.tokenizer = job, tokenizer
        self.id = new_id(job)
        self.created = int(time.time())
        self.object = "chat.completion" if job.chat else "text_completion"
        # a chat's answers read for tool calls and <think> blocks (none: text as it comes)
        fmt = job.format
        shaped = job.chat and fmt is not None and (job.tools is not None or fmt.thinks)
        self.shapes = (
            [AnswerShape(job.tools, fmt.parser, fmt.thinks) for _ in range(job.answers)]
            if shaped and fmt is not None
            else []
        )

    def _head(self, chunk: bool = False) -> dict[str, Any]:
        kind = self.object + (".chunk" if chunk and self.job.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.job.model}

    # -- whole answers ---------------------------------------------------------------------------
    def whole(self, results: Sequence[Any]) -> dict[str, Any]:
        """The non-streamed response for ``results`` (one per answer, prompt by prompt)."""
        choices = []
        for index, result in enumerate(results):
            choice: dict[str, Any] = {"index": index}
            finish = FINISH.get(result.finish_reason, "stop")
            if self.shapes:
                choice["message"], called = self.shapes[index].message(result.text)
                finish = "tool_calls" if called else finish
            elif self.job.chat:
                choice["message"] = {"role": "assistant", "content": result.text}
            else:
                choice["text"] = result.text
            choice["logprobs"] = self.logprobs(result)
            choice["finish_reason"] = finish
            choices.append(choice)
        return {**self._head(), "choices": choices, "usage": self.usage(results)}

    def usage(self, results: Sequence[Any]) -> dict[str, int]:
        """Token counts: each prompt once, every answer's tokens."""
        n = self.job.n
        prompt = sum(int(r.prompt_tokens) for r in results[::n])
        completion = sum(len(r.tokens) for r in results)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    # -- stream chunks ---------------------------------------------------------------------------
    def chunk(
        self,
        index: int,
        text: str | None = None,
        finish: str | None = None,
        logprobs: Any = None,
        role: bool = False,
        delta: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One choice's piece of the stream: its role first (chat), then text, then the
        finish reason (with the answer's log-probabilities, when asked for)."""
        choice: dict[str, Any] = {"index": index}
        if self.job.chat:
            fields: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                fields["content"] = text
            choice["delta"] = {**fields, **(delta or {})}
        else:
            choice["text"] = text or ""
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish
        out = {**self._head(chunk=True), "choices": [choice]}
        if self.job.include_usage:
            out["usage"] = None
        return out

    def pieces(self, index: int, text: str) -> list[dict[str, Any]]:
        """The :meth:`chunk` fields for answer ``index``'s next ``text`` (held back while it
        may be the start of a tool call or of a ``<think>`` mark)."""
        if not self.shapes:
            return [{"text": text}]
        return [{"delta": delta} for delta in self.shapes[index].feed(text)]

    def last_pieces(self, index: int, result: Any) -> tuple[list[dict[str, Any]], str]:
        """The :meth:`chunk` fields answer ``index`` still owes before its finish (held text,
        its tool calls), and its finish reason."""
        finish = FINISH.get(result.finish_reason, "stop")
        if not self.shapes:
            return [], finish
        deltas, called = self.shapes[index].end(result.text)
        return [{"delta": delta} for delta in deltas], "tool_calls" if called else finish

    def usage_chunk(self, results: Sequence[Any]) -> dict[str, Any]:
        return {**self._head(chunk=True), "choices": [], "usage": self.usage(results)}

    # -- log-probabilities -----------------------------------------------------------------------
    def logprobs(self, result: Any) -> dict[str, Any] | None:
        """The answer's log-probabilities in the endpoint's shape, or None if not asked for."""
        top_n = self.job.top_logprobs
        if top_n is None:
            return None
        tokens = list(result.tokens)
        chosen: list[float | None] = [float(p) for p in result.logprobs]
        tops: list[Any] = [list(t)[:top_n] for t in result.top_logprobs] or [[] for _ in tokens]
        if self.job.echo_logprobs:  # the prompt's tokens first, the first one unscored
            prompt = list(result.prompt_ids)
            if len(result.prompt_logprobs) != len(prompt) or not prompt:
                raise RuntimeError("echo with logprobs: the prompt was not scored")
            tokens = prompt + tokens
            chosen = [None if p is None else float(p) for p in result.prompt_logprobs] + chosen
            tops = [None, *(list(t)[:top_n] for t in result.prompt_top_logprobs[1:]), *tops]
        listed = (t for top in tops if top for t, _ in top)
        texts = self._texts({*tokens, *listed})
        if self.job.chat:
            return {
                "content": [
                    {
                        **_token(texts[token], logprob),
                        "top_logprobs": [_token(texts[t], p) for t, p in top],
                    }
                    for token, logprob, top in zip(tokens, chosen, tops, strict=True)
                ]
            }
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(texts[token])
        return {
            "tokens": [texts[t] for t in tokens],
            "token_logprobs": chosen,
            "top_logprobs": [None if top is None else {texts[t]: p for t, p in top} for top in tops]
            if top_n
            else None,
            "text_offset": offsets,
        }

    def _texts(self, ids: set[int]) -> dict[int, str]:
        """Each token's own text, decoded in one call."""
        order = sorted(ids)
        if not order:
            return {}
        decoded = self.tokenizer.decode([[t] for t in order], skip_special_tokens=False)
        return dict(zip(order, decoded, strict=True))


def _token(text: str, logprob: float | None) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
