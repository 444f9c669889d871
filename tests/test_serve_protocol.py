"""OpenAI request bodies read into pipeline calls: each field honoured with its meaning, or
refused by name; any JSON value in any field gives a job or an ApiError, nothing else."""

from __future__ import annotations

import json

import openvino_genai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npuw_kv.serve.protocol import (
    MAX_CHOICES,
    MAX_STOPS,
    ApiError,
    chat_job,
    completion_job,
    read_body,
)

MODELS = ("smollm2",)
USER = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return chat_job({"model": "smollm2", "messages": USER, **fields}, MODELS)


def refused(parse, body) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body, MODELS)
    return info.value


def test_fields_become_generation_fields():
    job = chat(
        max_completion_tokens=9, temperature=0.5, top_p=0.9, seed=-1, stop="END", n=3,
        presence_penalty=0.5, frequency_penalty=-0.5, top_k=40, min_p=0.1, ignore_eos=True,
        logprobs=True, top_logprobs=4, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    assert job.config == {
        "num_return_sequences": 3, "max_new_tokens": 9, "do_sample": True, "temperature": 0.5,
        "top_p": 0.9, "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "top_k": 40, "rng_seed": 2**64 - 1, "ignore_eos": True, "stop_strings": {"END"},
        "logprobs": 4,
    }  # fmt: skip
    assert job.stream and job.include_usage and job.top_logprobs == 4 and job.answers == 3


def test_sampling_defaults_follow_the_model_unless_asked():
    assert "do_sample" not in chat().config  # the model's generation config decides
    assert chat(temperature=0).config["do_sample"] is False
    assert chat(top_p=0.5).config["do_sample"] is True  # OpenAI's temperature 1 then
    assert chat(top_p=0.5).config["temperature"] == 1.0
    assert chat(logprobs=True).config["logprobs"] == 1 and chat(logprobs=True).top_logprobs == 0


def test_messages_roles_and_text_parts():
    job = chat_job(
        {
            "model": "smollm2",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                            "text": "b"}]},
            ],
        },
        MODELS,
    )  # fmt: skip
    assert job.inputs == [{"role": "system", "content": "be brief"},
                          {"role": "user", "content": "ab"}]  # fmt: skip
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    err = refused(chat_job, {"model": "smollm2", "messages": [{"role": "user", "content": image}]})
    assert err.param == "messages[0].content[0]" and "image_url" in err.message
    named = chat_job({"model": "smollm2", "messages": [{**USER[0], "name": "bob"}]}, MODELS)
    assert named.inputs[0]["name"] == "bob"  # OpenAI's participant name, for the template
    err = refused(chat_job, {"model": "smollm2", "messages": [{**USER[0], "audio": {"id": "a"}}]})
    assert err.param == "messages[0].audio"


def test_response_formats():
    fmt = chat(response_format={"type": "json_object"}).config["structured_output_config"]
    assert isinstance(fmt, openvino_genai.StructuredOutputConfig)
    assert json.loads(fmt.json_schema) == {"type": "object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    fmt = chat(response_format=spec).config["structured_output_config"]
    assert json.loads(fmt.json_schema) == schema
    assert "structured_output_config" not in chat(response_format={"type": "text"}).config
    err = refused(chat_job, {"model": "smollm2", "messages": USER, "response_format": {"type": 1}})
    assert err.param == "response_format"


def test_completion_fields():
    job = completion_job(
        {"model": "smollm2", "prompt": ["a", "b"], "n": 2, "logprobs": 2, "best_of": 2}, MODELS
    )
    assert job.prompts == 2 and job.answers == 4 and job.top_logprobs == 2
    assert job.config["apply_chat_template"] is False and job.config["logprobs"] == 2
    assert completion_job({"model": "smollm2", "prompt": "a", "echo": True}, MODELS).config["echo"]
    for body, param in [
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [[1], [2, True]]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "a", "logprobs": 9}, "logprobs"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
        ({"prompt": "a", "best_of": 3}, "best_of"),
        ({"prompt": "a", "suffix": "z"}, "suffix"),
        ({"prompt": ["a"] * (MAX_CHOICES + 1)}, "prompt"),
    ]:
        assert refused(completion_job, {"model": "smollm2", **body}).param == param


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"n": 0}, "n"),
        ({"n": MAX_CHOICES + 1}, "n"),
        ({"n": True}, "n"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"stop": [str(i) for i in range(MAX_STOPS + 1)]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
        ({"stream": "yes"}, "stream"),
        ({"seed": "x"}, "seed"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"echo": True}, "echo"),  # a completions field
        ({"messages": "hi"}, "messages"),
    ],
)
def test_bad_values_are_refused_by_name(fields, param):
    err = refused(chat_job, {"model": "smollm2", "messages": USER, **fields})
    assert err.status == 400 and err.param == param
    assert err.body()["error"]["param"] == param and err.body()["error"]["type"]


def test_unknown_model_is_404_and_bodies_must_be_objects():
    err = refused(chat_job, {"model": "gpt-9", "messages": USER})
    assert err.status == 404 and err.code == "model_not_found"
    for raw in (b"{", b"[]", b"\xff", b"nul"):
        with pytest.raises(ApiError):
            read_body(raw)
    assert chat(user="me", metadata={"a": "b"}).config  # no effect in OpenAI's API either
    assert chat(tools=[], logit_bias={}).config  # empty: nothing asked for


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                 max_size=3),
    max_leaves=6,
)  # fmt: skip
FIELDS = [
    "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "seed",
    "stop", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "stream",
    "stream_options", "response_format", "top_k", "min_p", "tools", "prompt", "echo", "best_of",
    "tool_choice", "parallel_tool_calls",
]  # fmt: skip


@settings(max_examples=1500, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=4), st.booleans())
def test_any_json_gives_a_job_or_an_api_error(fields, as_chat):
    body = {"model": "smollm2", "messages": USER, "prompt": "hi", **fields}
    parse = chat_job if as_chat else completion_job
    body.pop("prompt" if as_chat else "messages")
    try:
        job = parse(body, MODELS)
    except ApiError as err:
        assert err.status == 400 and err.param
        return
    assert 1 <= job.n <= MAX_CHOICES and job.answers >= 1
    for value in job.config.values():
        if isinstance(value, float):
            assert value == value and abs(value) != float("inf")


def test_several_choices_without_a_temperature_sample_as_openai():
    job = chat(n=2)
    assert job.config["do_sample"] is True and job.config["temperature"] == 1.0
    assert "do_sample" not in chat().config  # one choice: the model's own config (greedy)


@pytest.mark.parametrize(
    ("parse", "fields", "param"),
    [
        (chat_job, {"messages": USER, "max_tokens": 2**64}, "max_tokens"),
        (chat_job, {"messages": USER, "max_completion_tokens": 2**64}, "max_completion_tokens"),
        (completion_job, {"prompt": ["hi", ""]}, "prompt[1]"),
        (completion_job, {"prompt": ""}, "prompt"),
    ],
)
def test_a_value_the_library_would_refuse_is_refused_with_its_param(parse, fields, param):
    error = refused(parse, {"model": "smollm2", **fields})
    assert error.status == 400 and error.param == param, error.message
