"""``npuw-kv serve`` driven by the official ``openai`` client: every answer equal to what the
library gives for the same request at exact f32, streamed or not, alone or 32 at once."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import openai
import pytest
from conftest import EXACT_SERVE_ARGS

from npuw_kv.serve.child import ServeProcess

pytestmark = pytest.mark.slow(seconds=150)

MODEL = "smollm2"
QUESTIONS = [
    "Why is the sky blue?",
    "Name three fruits.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How do plants make food?",
    "What is 7 times 8?",
    "Give me a tip for sleeping well.",
    "What does a CPU do?",
]


@pytest.fixture(scope="module")
def server():
    proc = ServeProcess(*EXACT_SERVE_ARGS, "-p", "max_num_seqs=8", "--queue", "64")
    yield proc
    assert proc.stop() == 0, proc.stderr()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def streamed(stream) -> tuple[dict[int, str], dict[int, str], object]:
    """Each choice's text and finish reason from a chat stream, and the usage chunk's usage."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return texts, finish, usage


def stream_all(client, requests: list[tuple[str, int]]) -> list[str | None]:
    """Each (question, max_tokens) streamed by its own thread at once; each answer's text."""
    got: list[str | None] = [None] * len(requests)

    def one(i: int) -> None:
        question, n = requests[i]
        stream = client.chat.completions.create(
            model=MODEL, messages=chat(question), max_tokens=n, stream=True
        )
        texts, finish, _ = streamed(stream)
        assert set(finish) == {0}
        got[i] = texts[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return got


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert server.health()["status"] == "ok"


def test_chat_equals_the_library(client, f32_pipe):
    for question in QUESTIONS[:3]:
        reply = client.chat.completions.create(model=MODEL, messages=chat(question), max_tokens=24)
        alone = f32_pipe.generate(chat(question), max_new_tokens=24).results[0]
        assert reply.choices[0].message.content == alone.text
        assert reply.choices[0].finish_reason == alone.finish_reason
        assert reply.usage.prompt_tokens == alone.prompt_tokens
        assert reply.usage.completion_tokens == len(alone.tokens)


def test_stream_equals_whole_answer(client):
    kwargs = {"model": MODEL, "messages": chat(QUESTIONS[0]), "max_tokens": 32}
    whole = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    texts, finish, usage = streamed(stream)
    assert texts == {0: whole.choices[0].message.content}
    assert finish == {0: whole.choices[0].finish_reason}
    assert usage.total_tokens == whole.usage.total_tokens


def test_completions_prompts_and_choices(client, f32_pipe):
    prompts = ["The capital of France is", "One, two, three,"]
    reply = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=12, n=2, temperature=0.8, seed=5
    )
    alone = f32_pipe.generate(
        prompts, max_new_tokens=12, num_return_sequences=2, do_sample=True, temperature=0.8,
        rng_seed=5, apply_chat_template=False,
    )  # fmt: skip
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices] == list(alone.texts)
    greedy = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=8, logprobs=3)
    expected = f32_pipe.generate(prompts[0], max_new_tokens=8, apply_chat_template=False)
    assert greedy.choices[0].text == str(expected)
    lp = greedy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == greedy.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and chosen <= 0 and max(top.values()) == pytest.approx(chosen)


def test_chat_logprobs(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=chat("Hi"), max_tokens=6, logprobs=True, top_logprobs=2
    )
    content = reply.choices[0].logprobs.content
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    for item in content:  # greedy: the chosen token is the likeliest
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob == item.logprob
        assert bytes(item.bytes).decode() == item.token
    stream = client.chat.completions.create(
        model=MODEL, messages=chat("Hi"), max_tokens=6, logprobs=True, top_logprobs=2, stream=True
    )
    collected = [
        item for chunk in stream for c in chunk.choices if c.logprobs for item in c.logprobs.content
    ]  # they come with the answer's last chunk
    assert [(t.token, t.logprob) for t in collected] == [(t.token, t.logprob) for t in content]


def test_json_schema_output_validates(client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    reply = client.chat.completions.create(
        model=MODEL,
        messages=chat("Describe a person as JSON."),
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
    )
    value = json.loads(reply.choices[0].message.content)
    assert set(value) == {"name", "age"}
    assert isinstance(value["name"], str) and isinstance(value["age"], int)
    assert reply.choices[0].finish_reason == "stop"


def test_stop_strings(client):
    kwargs = {"model": MODEL, "messages": chat(QUESTIONS[0]), "max_tokens": 40}
    free = client.chat.completions.create(**kwargs).choices[0].message.content
    words = free.split()
    stop = " " + words[4]  # a word well inside the answer
    cut = client.chat.completions.create(**kwargs, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.message.content == free[: free.index(stop)]
    texts, finish, _ = streamed(client.chat.completions.create(**kwargs, stop=stop, stream=True))
    assert texts == {0: cut.message.content} and finish == {0: "stop"}


def test_closing_the_stream_cancels_the_request(server, client):
    before = server.health()["requests"]["cancelled"]
    stream = client.chat.completions.create(
        model=MODEL, messages=chat("Count to a thousand."), max_tokens=900, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    health = server.wait_idle()
    assert health["running"] == 0
    # the call ended because its answers were cancelled, not after its 900 tokens
    assert health["requests"]["cancelled"] == before + 1
    again = client.chat.completions.create(model=MODEL, messages=chat("Hi"), max_tokens=4)
    assert again.choices[0].message.content


def test_a_client_that_gives_up_cancels_its_request(server):
    """A non-streamed request whose client closes the connection (here: its timeout) ends
    too, rather than running its 900 tokens for nobody."""
    before = server.health()["requests"]["cancelled"]
    body = {"model": MODEL, "messages": chat("Count."), "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/chat/completions", json=body, timeout=1.0)
    health = server.wait_idle()
    assert health["running"] == 0 and health["requests"]["cancelled"] == before + 1


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": chat("hi")}, "model"),
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": chat("hi"), "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "messages": chat("hi"), "temperature": "hot"}, "temperature"),
        ({"model": MODEL, "messages": chat("hi"), "top_p": 1.5}, "top_p"),
        ({"model": MODEL, "messages": chat("hi"), "n": 10_000}, "n"),
        ({"model": MODEL, "messages": chat("hi"), "tools": [{"type": "x"}]}, "tools[0].type"),
        ({"model": MODEL, "messages": chat("hi"), "logit_bias": {"1": 5}}, "logit_bias"),
        ({"model": MODEL, "messages": chat("hi"), "frobnicate": 1}, "frobnicate"),
        ({"model": MODEL, "messages": chat("word " * 3000)}, "messages"),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ],
)
def test_bad_fields_are_named(server, body, param):
    reply = httpx.post(server.url + "/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    assert reply.json()["error"]["message"]


def test_bad_requests_keep_the_server_serving(server, client):
    raw = [b"{not json", b"[1, 2]", b'{"model": "smollm2", "messages": [], "temperature": NaN}']
    as_json = {"Content-Type": "application/json"}
    for body in raw:
        reply = httpx.post(server.url + "/chat/completions", content=body, headers=as_json,
                           timeout=30)  # fmt: skip
        assert reply.status_code == 400 and "error" in reply.json()
    nan = b'{"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "top_p": NaN}'
    reply = httpx.post(server.url + "/chat/completions", content=nan, headers=as_json, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "top_p"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=chat("hi"), max_tokens=2)
    assert httpx.get(server.root + "/v2/nothing", timeout=10).status_code == 404
    ok = client.chat.completions.create(model=MODEL, messages=chat("Hi"), max_tokens=4)
    assert ok.choices[0].message.content


def test_32_streaming_clients_each_get_their_own_answer(server, client, f32_pipe):
    requests = [(QUESTIONS[i % len(QUESTIONS)], 8 + (i % 5) * 4) for i in range(32)]
    expected = [f32_pipe.generate(chat(q), max_new_tokens=n).results[0].text for q, n in requests]
    got = stream_all(client, requests)
    assert got == expected
    assert server.wait_idle()["running"] == 0


def test_api_key_queue_limit_and_sigterm():
    proc = ServeProcess(
        *EXACT_SERVE_ARGS,
        "--api-key",
        "s3cret",
        "-p",
        "max_num_seqs=1",
        "--queue",
        "0",
        "--grace",
        "1",
    )
    try:
        anonymous = openai.OpenAI(base_url=proc.url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            anonymous.models.list()
        assert httpx.get(proc.root + "/health", timeout=10).status_code == 200  # open
        client = openai.OpenAI(base_url=proc.url, api_key="s3cret", max_retries=0, timeout=300)
        long = client.chat.completions.create(
            model=MODEL, messages=chat("Count to a thousand."), max_tokens=900, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        next(iter(long))  # it runs: the one turn is taken and nobody may wait
        busy = httpx.post(
            proc.url + "/chat/completions",
            json={"model": MODEL, "messages": chat("hi"), "max_tokens": 2},
            headers={"Authorization": "Bearer s3cret"},
            timeout=60,
        )
        assert busy.status_code == 429 and busy.headers["Retry-After"]
        assert busy.json()["error"]["type"] == "rate_limit_error"
        # a client gone half-way through its body: no traceback in the server's log
        _send_half_a_request(proc.root)
        # a stop signal while the stream runs: it is cancelled after the grace and ends with
        # finish reason "abort", then an error event the client raises on; exit code 0
        code = proc.stop(signal.SIGTERM)
        rest = []
        with pytest.raises(openai.APIError, match="server stopped"):
            rest.extend(long)
        assert rest and rest[-1].choices[0].finish_reason == "abort"
        assert code == 0, proc.stderr()
        assert "Traceback" not in proc.stderr() and "Exception" not in proc.stderr()
    finally:
        if proc.proc.poll() is None:
            proc.stop(signal.SIGKILL)


def _send_half_a_request(root: str) -> None:
    """Headers promising 100 bytes of body, 10 of them, then the connection closed."""
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(root)
    with socket.create_connection((where.hostname, where.port), timeout=10) as conn:
        conn.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Authorization: Bearer s3cret\r\n"
            b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"model": '
        )


def test_ctrl_c_stops_the_server_with_exit_code_0():
    proc = ServeProcess(*EXACT_SERVE_ARGS)
    client = openai.OpenAI(base_url=proc.url, api_key="unused", max_retries=0, timeout=300)
    assert client.chat.completions.create(model=MODEL, messages=chat("Hi"), max_tokens=3).choices
    assert proc.stop(signal.SIGINT) == 0, proc.stderr()
    assert "Traceback" not in proc.stderr()


def test_npu_path_serves_four_streaming_clients_together():
    """On the NPU path four streaming requests share packed generate steps (slots of one KV
    pool); each answer equals the one the same request gets alone."""
    proc = ServeProcess(
        "-d", "NPU", "--exact", "--chunk", "256", "--max-prompt-len", "1024",
        "--min-response-len", "64",
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=proc.url, api_key="unused", max_retries=0, timeout=600)
        requests = [(QUESTIONS[i], 6 + 2 * i) for i in range(4)]
        alone = [
            client.chat.completions.create(model=MODEL, messages=chat(q), max_tokens=n)
            .choices[0]
            .message.content
            for q, n in requests
        ]
        got = stream_all(client, requests)
        assert got == alone
        assert proc.wait_idle()["requests"]["completed"] == 8
        # the slots' prefix counters: every prompt token of the 8 requests looked up (none
        # found: a one-chunk prompt runs its chunk whether or not its prefix is held)
        metrics = httpx.get(proc.root + "/metrics", timeout=30).text
        queries = float(metrics.split("vllm:prefix_cache_queries_total{")[1].split()[1])
        hits = float(metrics.split("vllm:prefix_cache_hits_total{")[1].split()[1])
        assert queries > 8 * 10 and hits == 0
    finally:
        assert proc.stop() == 0, proc.stderr()
