"""Tool calling on ``/v1/chat/completions``: OpenAI's ``tools``, ``tool_choice`` and
``parallel_tool_calls`` read and checked, and the chat put to the model's template with them.

A template that renders tools itself (it names ``tools``) gets them, and the earlier turns'
``tool_calls`` and ``tool`` results, as OpenAI sends them (arguments as objects, as templates
expect).  A template that does not (SmolLM2's) would silently drop them, so here the tools are
described in the system message instead, with the Hermes ``<tool_call>`` form to answer in, and
earlier calls and results are written in that form.

``required`` and a named function are held to a JSON schema through the structured-output path,
so the arguments always parse and fit the tool's ``parameters``: the answer is then a JSON array
of ``{"name", "arguments"}`` (one item at most without ``parallel_tool_calls``) or, for a named
function, its arguments object.  ``auto`` leaves the model free and reads its calls back out
(:mod:`.tool_text`); ``none`` hides the tools from the model.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from typing import Any

from .api_error import bad

PARSERS = ("hermes", "llama3_json", "pythonic", "mistral")
PARSER_SETTING = ("auto", *PARSERS)  # ``--tool-call-parser``
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's function names


@dataclass
class ToolRequest:
    """The tools of one request and how the model may use them."""

    tools: list[dict[str, Any]]  # OpenAI's tool objects, checked
    choice: str = "auto"  # "auto", "required" or "none" ("required" when a function is named)
    name: str | None = None  # the function a named tool_choice calls
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        """The answer is held to :meth:`schema` (``required`` or a named function)."""
        return self.choice == "required"

    @property
    def names(self) -> list[str]:
        return [tool["function"]["name"] for tool in self.tools]

    def parameters(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                params = tool["function"].get("parameters")
                return params if params else {"type": "object"}
        raise KeyError(name)

    def schema(self) -> dict[str, Any]:
        """What a constrained answer is: the named function's arguments, or an array of
        calls of the given tools."""
        if self.name is not None:
            return self.parameters(self.name)
        call = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "arguments": self.parameters(name)},
                    "required": ["name", "arguments"],
                }
                for name in self.names
            ]
        }
        array: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return array


def read_tool_request(body: dict[str, Any]) -> ToolRequest | None:
    """The request's tools (None without any), every field checked."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", "parallel_tool_calls must be true or false")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad("tool_choice", "tool_choice needs tools")
        return None
    if not isinstance(tools, list):
        raise bad("tools", "tools must be a list of {'type': 'function', 'function': {...}}")
    checked = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    request = ToolRequest(checked, parallel=parallel is not False)
    names = request.names
    if len(set(names)) != len(names):
        raise bad("tools", "tools name the same function twice")
    if choice is None or choice in ("auto", "none", "required"):
        request.choice = choice or "auto"
    elif isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if name not in names:
            raise bad("tool_choice.function.name", f"tool_choice names {name!r}, not in tools")
        request.choice, request.name = "required", name
    else:
        raise bad("tool_choice", "tool_choice must be auto, none, required or "
                  "{'type': 'function', 'function': {'name': ...}}")  # fmt: skip
    return request


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise bad(f"{where}.type", f"{where} must be {{'type': 'function', 'function': {{...}}}}")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad(f"{where}.function", f"{where}.function must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        at = f"{where}.function.name"
        raise bad(at, f"{at} must match [A-Za-z0-9_-]{{1,64}}")
    for key, kind in (("description", str), ("parameters", dict), ("strict", bool)):
        value = function.get(key)
        if value is not None and not isinstance(value, kind):
            at = f"{where}.function.{key}"
            raise bad(at, f"{at} must be a {kind.__name__}")
    unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
    if unknown:
        at = f"{where}.function.{unknown[0]}"
        raise bad(at, f"{at} is not supported")
    return {"type": "function", "function": function}


# -- earlier turns ----------------------------------------------------------------------------
def read_tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, checked; arguments as objects (what chat
    templates render), or the string as given when it is not JSON."""
    if not isinstance(value, list) or not value:
        raise bad(where, f"{where} must be a non-empty list of calls")
    calls = []
    for i, call in enumerate(value):
        at = f"{where}[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad(at, f"{at} must be {{'id', 'type': 'function', 'function': {{'name', "
                      "'arguments'}}")  # fmt: skip
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, (str, dict)):
            raise bad(f"{at}.function.arguments", "arguments must be a JSON string")
        if isinstance(arguments, str):
            with contextlib.suppress(json.JSONDecodeError):  # kept as given: templates print it
                arguments = json.loads(arguments)
        calls.append({"id": str(call.get("id", f"call_{i}")), "type": "function",
                      "function": {"name": function["name"], "arguments": arguments}})  # fmt: skip
    return calls


class ChatFormat:
    """What the served model's chat template does with tools: whether it renders them, which
    form its calls take, whether it thinks in ``<think>`` blocks."""

    def __init__(self, *, renders_tools: bool = True, thinks: bool = False,
                 parser: str = "hermes") -> None:  # fmt: skip
        self.renders_tools, self.thinks, self.parser = renders_tools, thinks, parser

    @classmethod
    def of_template(cls, template: str, parser: str = "auto") -> ChatFormat:
        """Read from the chat template's text; ``parser`` (``--tool-call-parser``) overrides
        the form its calls are read in."""
        if parser not in PARSER_SETTING:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(PARSER_SETTING)}")
        return cls(
            renders_tools="tools" in template,
            thinks="<think>" in template,
            parser=parser if parser != "auto" else guess_parser(template),
        )

    @classmethod
    def of(cls, tokenizer: Any, parser: str = "auto") -> ChatFormat:
        try:
            template = str(tokenizer.chat_template or "")
        except Exception:  # a tokenizer without a template: chat requests fail on their own
            template = ""
        return cls.of_template(template, parser)

    def chat_inputs(self, messages: list[dict[str, Any]], request: ToolRequest | None) -> Any:
        """The pipeline's input for ``messages``: a ``ChatHistory`` with the tools when the
        template renders them, else plain messages (tools described in the system turn)."""
        import openvino_genai

        shown = request if request is not None and request.choice != "none" else None
        if shown is not None and self.renders_tools:
            history = openvino_genai.ChatHistory(messages)
            history.set_tools(shown.tools)
            return history
        if self.renders_tools:
            return messages
        out = [_as_text(message) for message in messages]
        if shown is not None:
            note = describe_tools(shown)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{note}"}
            else:
                out.insert(0, {"role": "system", "content": note})
        return out


def guess_parser(template: str) -> str:
    """The call form a chat template teaches its model (Hermes when it says nothing)."""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def describe_tools(request: ToolRequest) -> str:
    """The system-turn text that tells a template without tools what it may call and how."""
    lines = ["You can call these functions (JSON schemas of their arguments):"]
    lines += [json.dumps(tool["function"], ensure_ascii=False) for tool in request.tools]
    if request.name is not None:
        lines.append(f"Answer with the arguments of {request.name} as one JSON object.")
    elif request.constrained:
        lines.append('Answer with a JSON array of calls: [{"name": ..., "arguments": {...}}].')
    else:
        lines.append("To call one, answer with <tool_call>\n"
                     '{"name": <function name>, "arguments": <arguments object>}\n</tool_call>; '
                     "otherwise answer in plain text.")  # fmt: skip
    return "\n".join(lines)


def _as_text(message: dict[str, Any]) -> dict[str, Any]:
    """A message for a template that knows only roles and text: calls and results written in
    the Hermes form the tools' description teaches."""
    text = message.get("content") or ""
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
    calls = message.get("tool_calls")
    if calls:
        written = [
            "<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                          "arguments": c["function"]["arguments"]},
                                         ensure_ascii=False) + "\n</tool_call>"
            for c in calls
        ]  # fmt: skip
        text = "\n".join([text, *written] if text else written)
    return {"role": message["role"], "content": text}
