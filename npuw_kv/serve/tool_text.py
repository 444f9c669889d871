"""An answer's text as OpenAI's assistant message: ``content``, ``reasoning_content`` (a
``<think>`` block) and ``tool_calls``, read whole or as the text streams.

Calls are read in the form the chat template teaches (:func:`~.tools.guess_parser`):

* ``hermes`` (Qwen, Hermes, and the form described to templates without tools):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, text around them;
* ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` (the marker is a
  control token that decoding may drop, so an answer that starts with the array counts too);
* ``llama3_json``: the answer is ``{"name": ..., "parameters": {...}}`` objects (``;`` between
  them), after an optional ``<|python_tag|>``;
* ``pythonic``: the answer is a Python list of calls, ``[f(a=1), g(b="x")]``.

A constrained answer (``tool_choice`` required or named) is the JSON :meth:`ToolRequest.schema`
gave.  A call naming a function the request did not offer is not a call: the answer stays text.
When streaming, text goes out as soon as it cannot be the start of a call; from a call's first
mark on it is held, and the calls go out at the end as OpenAI streams them (a delta with the id
and name, then one with the arguments).
"""

from __future__ import annotations

import ast
import json
import uuid
from typing import Any

from .tools import ToolRequest

MARKS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}
_HERMES_END = "</tool_call>"
THINK, END_THINK = "<think>", "</think>"
PYTHON_TAG = "<|python_tag|>"


def split_reasoning(text: str) -> tuple[str | None, str]:
    """``(reasoning, content)`` of a template that thinks in ``<think>`` blocks."""
    body = text.lstrip()
    if body.startswith(THINK):
        inner, closed, rest = body[len(THINK) :].partition(END_THINK)
        return inner.strip(), rest.lstrip() if closed else ""
    if END_THINK in text:  # the generation prompt opened the block
        inner, _, rest = text.partition(END_THINK)
        return inner.strip(), rest.lstrip()
    return None, text


def read_calls(text: str, parser: str, request: ToolRequest) -> tuple[str, list[dict[str, Any]]]:
    """``(content, calls)`` of an answer; no calls (and the text whole) when it holds none
    that name an offered function."""
    try:
        content, found = _parse(text, parser, request)
    except (ValueError, SyntaxError, TypeError, AttributeError, KeyError):
        return text, []
    names = set(request.names)
    if not found or any(name not in names for name, _ in found):
        return text, []
    return content, [_openai_call(name, arguments) for name, arguments in found]


def _parse(text: str, parser: str, request: ToolRequest) -> tuple[str, list[tuple[str, Any]]]:
    if request.constrained:
        value = json.loads(text)
        if request.name is not None:
            return "", [(request.name, value)]
        return "", [(item["name"], item["arguments"]) for item in value]
    if parser == "hermes":
        return _hermes(text)
    if parser == "mistral":
        head, mark, tail = text.partition(MARKS["mistral"])
        if not mark and not text.lstrip().startswith("["):
            return text, []
        items = json.loads(tail if mark else text)
        return (head if mark else ""), [(item["name"], item.get("arguments", {})) for item in items]
    if parser == "llama3_json":
        return "", _llama3_json(text)
    if parser == "pythonic":
        return "", _pythonic(text)
    raise ValueError(parser)


def _hermes(text: str) -> tuple[str, list[tuple[str, Any]]]:
    outside, calls, rest = [], [], text
    while True:
        head, mark, tail = rest.partition(MARKS["hermes"])
        outside.append(head)
        if not mark:
            break
        inner, _, rest = tail.partition(_HERMES_END)  # an unclosed last call ends the text
        call = json.loads(inner)
        calls.append((call["name"], call.get("arguments", {})))
    return "".join(outside), calls


def _llama3_json(text: str) -> list[tuple[str, Any]]:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        call, at = decoder.raw_decode(body, at)
        calls.append((call["name"], call.get("parameters", call.get("arguments", {}))))
        while at < len(body) and body[at] in "; \n\t":
            at += 1
    return calls


def _pythonic(text: str) -> list[tuple[str, Any]]:
    tree = ast.parse(text.strip().removeprefix(PYTHON_TAG).strip(), mode="eval").body
    if not isinstance(tree, ast.List):
        raise ValueError("not a list of calls")
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            raise ValueError("not a call with keyword arguments")
        arguments = {str(kw.arg): ast.literal_eval(kw.value) for kw in node.keywords}
        calls.append((node.func.id, arguments))
    return calls


def _openai_call(name: str, arguments: Any) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": text}}  # fmt: skip


class AnswerShape:
    """One chat answer's text as message fields: :meth:`message` for a whole answer,
    :meth:`feed` and :meth:`end` for a streamed one."""

    def __init__(self, request: ToolRequest | None, parser: str, thinks: bool) -> None:
        self.request = request if request is not None and request.choice != "none" else None
        self.parser, self.thinks = parser, thinks
        self.text = ""  # everything fed so far
        self.sent = {"reasoning_content": "", "content": ""}  # what the deltas carried
        self.holding = self.request is not None and self.request.constrained

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The assistant message of the whole ``text``; whether it calls tools."""
        reasoning, content = split_reasoning(text) if self.thinks else (None, text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if self.request is None:
            return message, False
        content, calls = read_calls(content, self.parser, self.request)
        if not calls:
            return message, False
        message["content"] = content if content.strip() else None
        message["tool_calls"] = calls
        return message, True

    # -- streaming -------------------------------------------------------------------------------
    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas to send for the text streamed so far."""
        self.text += text
        reasoning, content = self._safe_split()
        deltas = self._more("reasoning_content", reasoning)
        if not self.holding:
            deltas += self._more("content", self._open_content(content))
        return deltas

    def end(self, text: str) -> tuple[list[dict[str, Any]], bool]:
        """The last deltas of the answer whose whole text is ``text``; whether it calls."""
        message, called = self.message(text)
        deltas = self._more("reasoning_content", message.get("reasoning_content") or "")
        deltas += self._more("content", message.get("content") or "")
        for index, call in enumerate(message.get("tool_calls", [])):
            function = call["function"]
            head = {"index": index, "id": call["id"], "type": "function",
                    "function": {"name": function["name"], "arguments": ""}}  # fmt: skip
            deltas.append({"tool_calls": [head]})
            arguments = {"index": index, "function": {"arguments": function["arguments"]}}
            deltas.append({"tool_calls": [arguments]})
        return deltas, called

    def _more(self, field: str, whole: str) -> list[dict[str, Any]]:
        """A delta with what ``whole`` adds to what was sent of ``field``, if anything."""
        sent = self.sent[field]
        if not whole.startswith(sent) or len(whole) == len(sent):
            return []
        self.sent[field] = whole
        return [{field: whole[len(sent) :]}]

    def _safe_split(self) -> tuple[str, str]:
        """Reasoning and content that can go out now: a partial ``<think>`` or ``</think>``
        mark is held back until the next text says what it is."""
        text = self.text
        if not self.thinks:
            return "", text
        body = text.lstrip()
        if len(body) < len(THINK) and THINK.startswith(body):
            return "", ""
        if not body.startswith(THINK):
            return "", text
        inner = body[len(THINK) :]
        if END_THINK in inner:
            reasoning, _, rest = inner.partition(END_THINK)
            return reasoning.strip(), rest.lstrip()
        return inner[: len(inner) - _partial_mark(inner, END_THINK)].lstrip(), ""

    def _open_content(self, content: str) -> str:
        """The part of ``content`` that cannot be a call's start; from a call's mark on, the
        rest is held to the end."""
        if self.request is None:
            return content
        mark = MARKS.get(self.parser)
        if mark is None:  # the whole answer is the calls, or text
            stripped = content.lstrip()
            if stripped[:1] in ("{", "[") or stripped.startswith(PYTHON_TAG[:1]):
                self.holding = True
                return ""
            return content
        head, found, _ = content.partition(mark)
        if found or (self.parser == "mistral" and content.lstrip()[:1] == "["):
            self.holding = True
            return head if found else ""
        return content[: len(content) - _partial_mark(content, mark)]


def _partial_mark(text: str, mark: str) -> int:
    """How many characters at the end of ``text`` could begin ``mark``."""
    for size in range(min(len(mark) - 1, len(text)), 0, -1):
        if mark.startswith(text[-size:]):
            return size
    return 0
