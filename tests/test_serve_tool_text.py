"""Tool calling's text side, without a model: requests read and refused by name, chats put to
templates with and without tools, calls read back in each form, and a streamed answer giving
exactly the whole answer's message however its text is split."""

from __future__ import annotations

import json

import openvino_genai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npuw_kv.serve.api_error import ApiError
from npuw_kv.serve.chat_messages import read_messages
from npuw_kv.serve.protocol import chat_job
from npuw_kv.serve.tool_text import AnswerShape, read_calls, split_reasoning
from npuw_kv.serve.tools import ChatFormat, ToolRequest, guess_parser, read_tool_request

pytestmark = pytest.mark.unit

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]
MODELS = ("m",)


def tools(**fields) -> ToolRequest:
    request = read_tool_request({"tools": TOOLS, **fields})
    assert request is not None
    return request


def refused(body) -> ApiError:
    with pytest.raises(ApiError) as info:
        chat_job({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}, MODELS)
    return info.value


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": "x"}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "x": 1}}]},
            "tools[0].function.x",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),  # without tools
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
    ],
)
def test_bad_tool_fields_are_refused_by_name(body, param):
    err = refused(body)
    assert err.status == 400 and err.param == param


def test_constrained_choices_are_json_schemas():
    required = tools(tool_choice="required", parallel_tool_calls=False)
    schema = required.schema()
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [item["properties"]["name"]["const"] for item in schema["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    assert "maxItems" not in tools(tool_choice="required").schema()
    named = tools(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.constrained and named.schema() == WEATHER["function"]["parameters"]
    assert tools(tool_choice={"type": "function", "function": {"name": "get_time"}}).schema() == {
        "type": "object"
    }
    job = chat_job({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                    "tool_choice": "required"}, MODELS)  # fmt: skip
    held = job.config["structured_output_config"]
    assert isinstance(held, openvino_genai.StructuredOutputConfig)
    assert json.loads(held.json_schema) == tools(tool_choice="required").schema()
    assert not tools().constrained and tools(tool_choice="none").choice == "none"


def test_messages_with_calls_results_and_names():
    messages = read_messages([
        {"role": "user", "content": "weather?", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "snow"},
    ])  # fmt: skip
    assert messages[0] == {"role": "user", "name": "ann", "content": "weather?"}
    assert "content" not in messages[1]  # a template tests content; null is left out
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "snow"}
    for bad, param in (
        ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
        ({"role": "user", "content": "x", "tool_calls": [{}]}, "messages[0].tool_calls"),
        ({"role": "assistant", "tool_calls": [{"function": {}}]}, "messages[0].tool_calls[0]"),
        ({"role": "user", "content": "x", "name": 3}, "messages[0].name"),
    ):
        with pytest.raises(ApiError) as info:
            read_messages([bad])
        assert info.value.param == param


HERMES_TEMPLATE = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>"


def test_template_forms_and_tools_put_where_the_template_reads_them():
    assert guess_parser(HERMES_TEMPLATE) == "hermes"
    assert guess_parser("{{ '[TOOL_CALLS]' }} tools") == "mistral"
    assert guess_parser("<|python_tag|> tools ipython") == "llama3_json"
    assert ChatFormat.of_template("{{ messages }}", "pythonic").parser == "pythonic"
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ChatFormat.of_template("", "xml")
    chat = [{"role": "user", "content": "hi"}]
    renders = ChatFormat.of_template(HERMES_TEMPLATE)
    history = renders.chat_inputs(chat, tools())
    assert isinstance(history, openvino_genai.ChatHistory)
    assert list(history.get_tools()) == TOOLS and list(history.get_messages()) == chat
    assert renders.chat_inputs(chat, tools(tool_choice="none")) == chat  # hidden from the model
    # a template without tools: described in the system turn, earlier calls written out
    plain = ChatFormat.of_template("{{ message['content'] }}")
    assert not plain.renders_tools and plain.parser == "hermes"
    turns = [
        {"role": "system", "content": "be brief"},
        {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "c", "content": "noon"},
    ]  # fmt: skip
    out = plain.chat_inputs(turns, tools())
    assert out[0]["content"].startswith("be brief\n\n") and '"get_weather"' in out[0]["content"]
    assert "<tool_call>" in out[0]["content"]
    assert out[1]["content"] == '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert out[2] == {"role": "user", "content": "<tool_response>\nnoon\n</tool_response>"}
    get_time = {"type": "function", "function": {"name": "get_time"}}
    named = plain.chat_inputs(chat, tools(tool_choice=get_time))
    assert named[0]["role"] == "system" and "arguments of get_time" in named[0]["content"]


CALL_TEXTS = {
    "hermes": 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
    '{"name": "get_time", "arguments": {}}]',
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
    '{"name": "get_time", "parameters": {}}',
    "pythonic": '[get_weather(city="Oslo"), get_time()]',
}


@pytest.mark.parametrize("parser", sorted(CALL_TEXTS))
def test_calls_are_read_in_each_form(parser):
    content, calls = read_calls(CALL_TEXTS[parser], parser, tools())
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Oslo"}, {}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert content.strip() == ("Checking." if parser == "hermes" else "")
    # a function not offered, or text that is not a call: the answer stays text
    unknown = CALL_TEXTS[parser].replace("get_time", "rm_rf")
    assert read_calls(unknown, parser, tools()) == (unknown, [])
    assert read_calls("Just text.", parser, tools()) == ("Just text.", [])


def test_constrained_answers_are_read_as_their_json():
    required = tools(tool_choice="required")
    _, calls = read_calls('[{"name": "get_time", "arguments": {}}]', "hermes", required)
    assert [c["function"]["name"] for c in calls] == ["get_time"]
    named = tools(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    _, calls = read_calls('{"city": "Oslo"}', "hermes", named)
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    cut = '[{"name": "get_time", "argu'  # max_tokens ran out: text, no calls
    assert read_calls(cut, "hermes", required) == (cut, [])


def test_think_blocks_split_into_reasoning():
    assert split_reasoning("<think>a plan</think>\n\nThe answer.") == ("a plan", "The answer.")
    assert split_reasoning("opened by the prompt</think>Done") == ("opened by the prompt", "Done")
    assert split_reasoning("<think>never closed") == ("never closed", "")
    assert split_reasoning("No thoughts.") == (None, "No thoughts.")
    message, called = AnswerShape(None, "hermes", True).message("<think>x</think>y")
    assert message == {"role": "assistant", "content": "y", "reasoning_content": "x"} and not called


ANSWERS = [
    *CALL_TEXTS.values(),
    "Plain text with < and [ and { inside.",
    "<tool_call>not json</tool_call>",
    "<think>I should look it up.</think>\n" + CALL_TEXTS["hermes"],
    "<think>Nothing to call.</think>\nThe sky is blue.",
    "Almost a mark: <tool_cal and more",
]


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(ANSWERS),
    st.sampled_from(sorted(CALL_TEXTS)),
    st.booleans(),
    st.lists(st.integers(1, 12), min_size=1, max_size=40),
)
def test_a_streamed_answer_gives_the_whole_answers_message(text, parser, thinks, cuts):
    """However the text arrives, the deltas add up to the message of the whole text."""
    whole, called = AnswerShape(tools(), parser, thinks).message(text)
    shape = AnswerShape(tools(), parser, thinks)
    deltas, at = [], 0
    for size in cuts:
        deltas += shape.feed(text[at : at + size])
        at += size
    deltas += shape.feed(text[at:])
    last, streamed_called = shape.end(text)
    deltas += last
    assert streamed_called == called
    for field in ("content", "reasoning_content"):
        joined = "".join(d.get(field, "") for d in deltas)
        assert joined == (whole.get(field) or ""), field
    heads = [d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]
    args = [d["tool_calls"][0]["function"]["arguments"] for d in deltas
            if "tool_calls" in d and "id" not in d["tool_calls"][0]]  # fmt: skip
    expected = whole.get("tool_calls", [])
    assert [h["function"]["name"] for h in heads] == [c["function"]["name"] for c in expected]
    assert args == [c["function"]["arguments"] for c in expected]
    assert [h["index"] for h in heads] == list(range(len(expected)))
