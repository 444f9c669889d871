"""A chat request's ``messages``, checked: OpenAI's roles (``developer`` read as ``system``),
text content, a ``name``, an assistant's ``tool_calls`` (its content may then be null) and
``tool`` results with their ``tool_call_id``."""

from __future__ import annotations

from typing import Any

from .api_error import bad
from .tools import read_tool_calls

ROLES = {
    "system": "system", "developer": "system", "user": "user", "assistant": "assistant",
    "tool": "tool",
}  # fmt: skip
# fields a message may carry beyond role and content, per role
_FIELDS = {"name"}
_ASSISTANT = {"name", "tool_calls"}
_TOOL = {"tool_call_id", "name"}


def read_messages(value: Any) -> list[dict[str, Any]]:
    """The messages as the chat template gets them (content as text; an assistant turn that
    only calls tools has no content)."""
    if not isinstance(value, list) or not value:
        raise bad("messages", "messages must be a non-empty list of {'role', 'content'} objects")
    return [_message(message, f"messages[{i}]") for i, message in enumerate(value)]


def _message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise bad(where, f"{where} must be an object with role and content")
    role = message.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}")
    allowed = _ASSISTANT if role == "assistant" else _TOOL if role == "tool" else _FIELDS
    extra = sorted(k for k, v in message.items() if k not in ("role", "content", *allowed) and v)
    if extra:
        raise bad(f"{where}.{extra[0]}", f"{where}.{extra[0]} is not supported")
    out: dict[str, Any] = {"role": ROLES[role]}
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise bad(f"{where}.name", f"{where}.name must be a string")
        out["name"] = name
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = read_tool_calls(calls, f"{where}.tool_calls")
        if message.get("content") is not None:
            out["content"] = _content(message["content"], where)
        return out
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise bad(
                f"{where}.tool_call_id", f"{where}.tool_call_id is required for a tool result"
            )
        out["tool_call_id"] = call_id
    out["content"] = _content(message.get("content"), where)
    return out


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(f"{where}.content[{j}]", f"only text content is supported, got {kind}")
            text = part.get("text")
            if not isinstance(text, str):
                raise bad(f"{where}.content[{j}].text", "a text part needs a string text")
            parts.append(text)
        return "".join(parts)
    raise bad(f"{where}.content", f"{where}.content must be a string or a list of text parts")
