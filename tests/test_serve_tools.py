"""Tool calling through ``npuw-kv serve`` with the clients people use: the ``openai`` client's
``tools`` and langchain-openai's ``bind_tools`` / function-calling structured output get valid
calls from SmolLM2 (``required`` and named choices are held to the tools' schemas), streamed
calls equal whole ones, earlier calls and tool results are taken, and a template that renders
tools gets them (``--chat-template``)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import openvino_genai
import pytest
from conftest import EXACT_SERVE_ARGS
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from npuw_kv.serve.child import ServeProcess

pytestmark = pytest.mark.slow(seconds=90)

MODEL = "smollm2"
TEMPLATE = Path(__file__).parent / "data" / "hermes_tools_template.jinja"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(exact_server):
    return openai.OpenAI(base_url=exact_server.url, api_key="unused", max_retries=0, timeout=300)


def valid(call, tools=(WEATHER, TIME)) -> dict:
    """The call's arguments, checked against the schema of the tool it names."""
    spec = {t["function"]["name"]: t["function"] for t in tools}[call.function.name]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, spec.get("parameters", {"type": "object"}))
    return arguments


def streamed_calls(stream) -> tuple[list[dict], str | None, str]:
    """The tool calls a stream's deltas add up to (as the openai client's users add them),
    its finish reason, and its content."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                call["name"] += (delta.function.name or "") if delta.function else ""
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content


def test_required_gives_a_valid_call_whole_and_streamed(client):
    args = {"model": MODEL, "messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 80}
    whole = client.chat.completions.create(**args, tool_choice="required")
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(c.type == "function" and c.id.startswith("call_") for c in calls)
    for call in calls:
        valid(call)
    got, finish, content = streamed_calls(
        client.chat.completions.create(**args, tool_choice="required", stream=True)
    )
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in got] == [
        (c.function.name, c.function.arguments) for c in calls
    ]  # greedy: the same answer


def test_a_named_function_is_called_with_its_schema(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for parallel in (True, False):
        answer = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[TIME, WEATHER], tool_choice=named,
            parallel_tool_calls=parallel, max_tokens=80,
        )  # fmt: skip
        (call,) = answer.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        arguments = valid(call)
        assert set(arguments) >= {"city", "unit"}


def test_earlier_calls_and_tool_results_are_taken(client):
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        {"role": "user", "name": "ann", "content": "And should I take an umbrella?"},
    ]  # fmt: skip
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=20
    )
    choice = answer.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    # the history was rendered: the prompt holds the earlier call and its result
    bare = client.chat.completions.create(model=MODEL, messages=messages[-1:], max_tokens=1)
    assert answer.usage.prompt_tokens > bare.usage.prompt_tokens + 20


def test_langchain_bind_tools_and_structured_output(exact_server):
    llm = ChatOpenAI(model=MODEL, base_url=exact_server.url, api_key="unused", max_tokens=80,
                     temperature=0, max_retries=0, timeout=300)  # fmt: skip

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"sunny in {city}"

    bound = llm.bind_tools([get_weather], tool_choice="required")
    message = bound.invoke([HumanMessage("What is the weather in Paris?")])
    assert isinstance(message, AIMessage) and message.tool_calls
    call = message.tool_calls[0]
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str)
    # the call's result goes back and the model answers in text
    follow = llm.bind_tools([get_weather]).invoke(
        [HumanMessage("What is the weather in Paris?"), message,
         ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    )  # fmt: skip
    assert isinstance(follow, AIMessage) and not follow.tool_calls and follow.content

    class City(BaseModel):
        """A city and its country."""

        name: str
        country: str

    city = llm.with_structured_output(City, method="function_calling").invoke("Paris is in")
    assert isinstance(city, City) and city.name and city.country


def test_a_template_with_tools_gets_them(smol_dir):
    """With ``--chat-template`` naming a template that renders tools, ``auto`` puts them in
    the prompt the template's way (the prompt is exactly that long) and the answer is either
    text or calls of the offered tools."""
    template = TEMPLATE.read_text()
    tokenizer = openvino_genai.Tokenizer(str(smol_dir))
    history = openvino_genai.ChatHistory(ASK)
    history.set_tools([WEATHER])
    prompt = tokenizer.apply_chat_template(history, True, chat_template=template)
    assert '"get_weather"' in prompt
    expected = tokenizer.encode(prompt, add_special_tokens=False).input_ids.get_size()
    proc = ServeProcess(*EXACT_SERVE_ARGS, "--chat-template", str(TEMPLATE),
                        "--tool-call-parser", "hermes")  # fmt: skip
    try:
        client = openai.OpenAI(base_url=proc.url, api_key="unused", max_retries=0, timeout=300)
        answer = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=40
        )
        assert answer.usage.prompt_tokens == expected
        message = answer.choices[0].message
        if message.tool_calls:
            assert answer.choices[0].finish_reason == "tool_calls"
            for call in message.tool_calls:
                valid(call, [WEATHER])
        else:
            assert message.content and "<tool_call>" not in message.content
        plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
        assert plain.usage.prompt_tokens < expected  # no tools asked for: none rendered
    finally:
        assert proc.stop() == 0, proc.stderr()


def test_bad_tool_templates_and_parsers_are_refused_before_loading(tmp_path):
    empty = tmp_path / "empty.jinja"
    empty.write_text("  ")
    for args, says in (
        (("--chat-template", str(empty)), "--chat-template"),
        (("--chat-template", str(tmp_path / "missing.jinja")), "--chat-template"),
        (("--tool-call-parser", "xml"), "--tool-call-parser"),
    ):
        with pytest.raises(RuntimeError) as info:
            ServeProcess(*args)
        assert says in str(info.value)
