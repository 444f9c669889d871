"""``npuw-kv serve --ray``: the routing policy, the relay and the metrics merge alone (unit),
then a real two-node Ray cluster on 127.0.0.1 (a head and one more node process, one CPU
each): two replicas answer as one server does, and prefix routing keeps a chat workload's
prompts where their prefixes are."""

from __future__ import annotations

import asyncio
import json
import time

import openai
import pytest
from conftest import EXACT_SERVE_ARGS

from npuw_kv.cli.commands import main
from npuw_kv.cluster.affinity import PrefixAffinity, block_hashes, prompt_text
from npuw_kv.cluster.forward import Forwarded, drive
from npuw_kv.cluster.metrics_merge import merge_metrics

unit = pytest.mark.unit


@unit
def test_prompt_text_reads_chats_and_completions():
    chat = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        ]
    }
    assert prompt_text("/v1/chat/completions", json.dumps(chat).encode()) == (
        "<system>Be brief.\n<user>Hi\n"
    )
    assert prompt_text("/v1/completions", b'{"prompt": "Once upon"}') == "Once upon"
    assert prompt_text("/v1/completions", b'{"prompt": ["A", "B"]}') == "A"
    assert prompt_text("/v1/completions", b'{"prompt": [5, 7]}') == "5 7 "
    for path, body in (
        ("/v1/models", b""),
        ("/v1/completions", b"{bad"),
        ("/v1/chat/completions", b'{"messages": 3}'),
        ("/tokenize", b"[]"),
    ):
        assert prompt_text(path, body) == ""


@unit
def test_block_hashes_chain_whole_pieces():
    a, b = block_hashes("x" * 64 + "y" * 64 + "z" * 10), block_hashes("x" * 64 + "q" * 64)
    assert len(a) == 2 and len(b) == 2  # the 10-character tail is no whole piece
    assert a[0] == b[0] and a[1] != b[1]
    assert block_hashes("y" * 64 + "x" * 64)[1] != a[1]  # a piece's hash depends on the ones before


@unit
def test_affinity_follows_the_prefix_unless_that_replica_is_much_busier():
    policy = PrefixAffinity(block_chars=4, imbalance=2)
    policy.record("a", "one two three four ")
    policy.record("b", "five six seven eight ")
    follow_up = "one two three four and more"
    assert policy.rank(follow_up, {"a": 1, "b": 0})[0] == "a"
    assert policy.rank(follow_up, {"a": 2, "b": 0})[0] == "a"  # at the imbalance: still kept
    assert policy.rank(follow_up, {"a": 3, "b": 0}) == ["b", "a"]  # past it: the least busy
    assert policy.rank("five six seven eight!", {"a": 0, "b": 1})[0] == "b"
    assert policy.rank("", {"a": 1, "b": 0}) == ["b", "a"]


@unit
def test_affinity_spreads_new_prompts_and_forgets_what_it_must():
    policy = PrefixAffinity(block_chars=4, blocks_per_replica=3, min_lead=2)
    shared = "You are kind. "  # 3 whole pieces of 4
    policy.record("a", shared + "Hello")
    assert len(policy.held["a"]) == 3  # capped: the prompt's last piece went first
    assert policy.matched("a", block_hashes(shared, 4)) == 3
    policy.record("b", shared[:8])  # b holds the system prompt's first 2 pieces of 3
    new = shared + "Tell me about cats"
    assert policy.rank(new, {"a": 0, "b": 0})[0] == "b"  # a leads by one piece: too little
    eager = PrefixAffinity(block_chars=4, min_lead=1)
    eager.held = {name: held.copy() for name, held in policy.held.items()}
    assert eager.rank(new, {"a": 0, "b": 0})[0] == "a"  # one piece ahead is enough for it
    policy.record("a", "abcdefgh")
    assert policy.matched("a", block_hashes("abcdefgh", 4)) == 2
    assert policy.rank("abcdefgh and on", {"a": 1, "b": 0})[0] == "a"
    policy.forget("a")
    assert policy.matched("a", block_hashes("abcdefgh", 4)) == 0
    with pytest.raises(ValueError, match="min_lead"):
        PrefixAffinity(min_lead=0)


@unit
def test_merged_metrics_keep_each_replicas_series():
    from prometheus_client import CollectorRegistry, Counter, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    def exposition(value: float) -> str:
        registry = CollectorRegistry()
        counter = Counter("vllm:prompt_tokens", "Prompt tokens.", ["model_name"], registry=registry)
        counter.labels("m").inc(value)
        return generate_latest(registry).decode()

    merged = merge_metrics({"r1": exposition(3), "r2": exposition(5)}).decode()
    samples = {
        s.labels["replica"]: s.value
        for family in text_string_to_metric_families(merged)
        for s in family.samples
        if s.name == "vllm:prompt_tokens_total"
    }
    assert samples == {"r1": 3.0, "r2": 5.0}
    assert merged.count("# TYPE vllm:prompt_tokens_total counter") == 1


@unit
def test_replica_totals_read_the_merged_metrics(monkeypatch):
    import io
    import urllib.request

    from prometheus_client import CollectorRegistry, Counter, generate_latest

    from npuw_kv.cluster import local

    def exposition(prompt: float, hits: float) -> str:
        registry = CollectorRegistry()
        for name, value in (("vllm:prompt_tokens", prompt), ("vllm:prefix_cache_hits", hits)):
            Counter(name, "-", ["model_name"], registry=registry).labels("m").inc(value)
        return generate_latest(registry).decode()

    merged = merge_metrics({"a": exposition(4, 2), "b": exposition(6, 3)})
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: io.BytesIO(merged))
    assert local.replica_totals("http://x") == {
        "a": {"prompt": 4.0, "hits": 2.0, "queries": 0.0},
        "b": {"prompt": 6.0, "hits": 3.0, "queries": 0.0},
    }


@unit
def test_drive_relays_an_app_and_tells_it_when_the_reader_left():
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    seen: dict[str, bool] = {}

    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"got": (await request.json())["x"], "q": request.url.query})

    async def endless(request: Request) -> StreamingResponse:
        async def pieces():
            try:
                while True:
                    yield "data: x\n\n"
                    await asyncio.sleep(0.01)
            finally:
                seen["closed"] = True

        return StreamingResponse(pieces(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/echo", echo, methods=["POST"]), Route("/endless", endless)])

    def request(method: str, path: str, body: bytes = b"") -> Forwarded:
        return Forwarded(method, path, b"a=1", ((b"host", b"127.0.0.1"),), body)

    async def scenario() -> None:
        messages = [m async for m in drive(app, request("POST", "/echo", b'{"x": 7}'))]
        assert messages[0]["status"] == 200
        assert json.loads(b"".join(m.get("body", b"") for m in messages[1:])) == {
            "got": 7,
            "q": "a=1",
        }
        stream = drive(app, request("GET", "/endless"))
        assert (await stream.__anext__())["status"] == 200
        await stream.__anext__()
        await stream.aclose()  # the endpoint stopped reading: its client left
        assert seen.get("closed")

    asyncio.run(scenario())


@unit
@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "--replicas", "2"], "--replicas is for --ray"),
        (["serve", "--router", "round-robin"], "--router is for --ray"),
        (["serve", "--ray", "--header-timeout", "3"], "--header-timeout is not used with --ray"),
        (["serve", "--ray", "--replicas", "3-2"], "MIN <= MAX"),
        (["serve", "--ray", "--replicas", "two"], "N or MIN-MAX"),
    ],
)
def test_ray_flags_are_refused_where_they_mean_nothing(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


# --- a real cluster ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    from npuw_kv.cluster.local import LocalCluster

    with LocalCluster(nodes=2, cpus=1) as local:
        yield local


def ray_server(cluster, *args: str):
    from npuw_kv.serve.child import ServeProcess

    return ServeProcess("--ray", cluster.address, *args, *EXACT_SERVE_ARGS)


@pytest.mark.slow(120)
def test_two_replicas_answer_as_one_server_does(cluster, exact_server):
    server = ray_server(cluster, "--replicas", "2", "--router", "round-robin")
    try:
        clients = [openai.OpenAI(base_url=s.url, api_key="-") for s in (exact_server, server)]
        model = clients[0].models.list().data[0].id
        assert [m.id for m in clients[1].models.list().data] == [model]
        questions = [
            "What is the capital of France?",
            "Name three colours.",
            "Write a haiku about rain.",
            "What is 2 + 2?",
        ]
        for question in questions:  # round-robin: each replica answers two of them
            messages = [{"role": "user", "content": question}]
            whole, streamed = [], []
            for client in clients:
                reply = client.chat.completions.create(
                    model=model, messages=messages, max_tokens=24, temperature=0
                )
                whole.append((reply.choices[0].message.content, reply.usage.completion_tokens))
                stream = client.chat.completions.create(
                    model=model, messages=messages, max_tokens=24, temperature=0, stream=True
                )
                streamed.append(
                    "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                )
            assert whole[0] == whole[1] and streamed[0] == streamed[1] == whole[0][0]
        texts = [
            client.completions.create(
                model=model, prompt="Once upon a time", n=2, max_tokens=12, temperature=0.8, seed=7
            )
            for client in clients
        ]
        assert [c.text for c in texts[0].choices] == [c.text for c in texts[1].choices]
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            clients[1].chat.completions.create(model=model, messages=messages, max_tokens=-1)
        stream = clients[1].chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Tell a long story."}],
            max_tokens=400,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for n, _ in enumerate(stream):
            if n == 3:
                break
        stream.close()  # the client leaves: its request is cancelled on its replica
        deadline, cancelled = time.monotonic() + 30, 0
        while time.monotonic() < deadline and not cancelled:  # round-robin: both replicas
            replies = [server.health() for _ in range(2)]
            if all(h["running"] == 0 for h in replies):
                cancelled = sum(h["requests"].get("cancelled", 0) for h in replies)
            time.sleep(0.2)
        assert cancelled == 1
        time.sleep(2.5)  # replicas leave their metrics every second
        from npuw_kv.cluster.local import replica_totals

        totals = replica_totals(server.root)
        assert len(totals) == 2 and all(t["prompt"] > 0 for t in totals.values())
    finally:
        assert server.stop() == 0, server.stderr()


@pytest.mark.slow(150)
def test_prefix_routing_keeps_chats_where_their_prefixes_are(cluster):
    from npuw_kv.cluster.local import chats, replica_totals

    rates = {}
    for router in ("prefix", "round-robin"):
        server = ray_server(cluster, "--replicas", "2", "--router", router)
        try:
            chats(server.url, server.models()[0], count=8, turns=6)
            time.sleep(2.5)
            totals = replica_totals(server.root)
        finally:
            assert server.stop() == 0, server.stderr()
        hits = sum(t["hits"] for t in totals.values())
        rates[router] = hits / sum(t["queries"] for t in totals.values())
        prompts = sorted(t["prompt"] for t in totals.values())
        assert len(prompts) == 2 and prompts[0] > 0.3 * sum(prompts), (router, totals)  # spread
    print(f"prefix-cache hits: {rates}")
    assert rates["prefix"] >= 0.8, rates
    assert rates["round-robin"] < rates["prefix"] - 0.15, rates


def model_replicas() -> list[str]:
    """The Ray actor names of the model deployment's replicas (the driver must be connected)."""
    import ray

    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::") and "#model#" in a["name"]
    ]


@pytest.mark.slow(150)
def test_a_replica_killed_mid_load_cuts_no_answer_silently(cluster):
    import threading

    import ray

    server = ray_server(cluster, "--replicas", "2", "--router", "round-robin")
    outcomes: dict[int, str] = {}
    started = threading.Barrier(7)
    try:
        client = openai.OpenAI(base_url=server.url, api_key="-", max_retries=0)
        model = server.models()[0]

        def ask(i: int) -> None:
            text = ""
            try:
                stream = client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": f"Tell story {i}."}],
                    max_tokens=400,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                finish = None
                for n, chunk in enumerate(stream):
                    if n == 2:
                        started.wait(timeout=120)
                    if chunk.choices:
                        text += chunk.choices[0].delta.content or ""
                        finish = chunk.choices[0].finish_reason or finish
                outcomes[i] = f"finished {finish}" if finish else "cut silently"
            except openai.APIError as exc:
                outcomes[i] = f"error {exc}"

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        started.wait(timeout=120)  # every stream has its first tokens
        ray.init(address=cluster.address)
        try:
            names = model_replicas()
            assert len(names) == 2, names
            ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
            for t in threads:
                t.join(timeout=300)
            assert len(outcomes) == 6, outcomes
            assert not [o for o in outcomes.values() if o == "cut silently"], outcomes
            assert sum(o == "finished length" for o in outcomes.values()) >= 2, outcomes
            assert (
                sum("replica_died" in o or "stopped mid-stream" in o for o in outcomes.values())
                >= 2
            ), outcomes
            reply = client.chat.completions.create(  # the survivor, or the new one, answers
                model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
            assert reply.choices[0].finish_reason in ("length", "stop")
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:  # Ray Serve starts a replica in its place
                alive = [name for name in model_replicas() if name != names[0]]
                if len(alive) == 2 and server.health()["status"] == "ok":
                    break
                time.sleep(1)
            assert len(alive) == 2, alive
        finally:
            ray.shutdown()
    finally:
        assert server.stop() == 0, server.stderr()


@pytest.mark.slow(20)
def test_a_model_that_does_not_load_is_named_and_nothing_is_left(cluster):
    with pytest.raises(RuntimeError, match="replicas did not start: .*not found"):
        ray_server(cluster, "-m", "/nonexistent/model.gguf")
    server = ray_server(cluster, "--replicas", "1")  # the failed application was deleted
    try:
        assert server.health()["status"] == "ok"
    finally:
        assert server.stop() == 0, server.stderr()


@pytest.mark.slow(120)
def test_accuracy_on_ray_gives_the_local_report(cluster, tmp_path):
    import subprocess
    import sys

    args = ["accuracy", "--prompt-lens", "64,160", "--new-tokens", "8", "--devices", "CPU",
            "--modes", "exact", "--no-peer"]  # fmt: skip
    rows = {}
    for where in ("local", "ray"):
        extra = ["--ray", cluster.address] if where == "ray" else []
        out = tmp_path / where
        proc = subprocess.run(
            [sys.executable, "-m", "npuw_kv.cli", *args, *extra, "--out", str(out)],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows[where] = json.loads((out / "results.json").read_text())
        assert (out / "report.md").exists() and (out / "accuracy.png").exists()
    assert [r["name"] for r in rows["ray"]] == ["CPU/exact/C256/64", "CPU/exact/C256/160"]
    assert rows["ray"] == rows["local"]
