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
        (["serve", "--models", "m.txt"], "--models is for --ray"),
    ],
)
def test_ray_flags_are_refused_where_they_mean_nothing(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


class _Handle:
    """A model deployment's handle, as the endpoint calls it, over an in-process app."""

    def __init__(self, app) -> None:
        self.app, self.forward = app, self

    def options(self, stream: bool):
        return self

    def remote(self, forwarded: Forwarded):
        return _Stream(drive(self.app, forwarded))


class _Stream:
    def __init__(self, messages) -> None:
        self.messages = messages

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.messages.__anext__()

    def cancel(self) -> None:
        pass


def _model_app(name: str):
    """A stand-in for one model's server: the model it serves, an API key on /v1/models."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def models(request):
        if request.headers.get("authorization") != "Bearer k":
            return JSONResponse({"error": {"message": "key"}}, status_code=401)
        return JSONResponse({"object": "list", "data": [{"id": name}]})

    async def answer(request):
        body = await request.json()
        return JSONResponse({"by": name, "model": body.get("model")})

    async def health(request):
        return JSONResponse({"status": "ok", "running": 0})

    return Starlette(routes=[Route("/v1/models", models), Route("/health", health),
                             Route("/v1/chat/completions", answer, methods=["POST"]),
                             Route("/tokenize", answer, methods=["POST"])])  # fmt: skip


@unit
def test_endpoint_sends_each_request_to_the_model_it_names():
    from starlette.requests import Request

    from npuw_kv.cluster.endpoint import Endpoint, requested_model

    def call(endpoint, method: str, path: str, body: dict | None = None, key: str = "k"):
        raw = json.dumps(body).encode() if body is not None else b""
        path, _, query = path.partition("?")
        auth = [(b"authorization", f"Bearer {key}".encode())]
        scope = {"type": "http", "method": method, "path": path, "query_string": query.encode(),
                 "headers": auth, "client": None}  # fmt: skip

        async def receive():
            return {"type": "http.request", "body": raw, "more_body": False}

        async def run():
            response = await endpoint(Request(scope, receive))
            sent: list[dict] = []

            async def send(message):
                sent.append(message)

            await response(scope, receive, send)
            return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))

        return asyncio.run(run())

    assert requested_model(None, b"model=b") == "b"
    assert requested_model({"model": 3}, b"") is None
    two = Endpoint({"a": _Handle(_model_app("a")), "b": _Handle(_model_app("b"))}, [])
    chat = "/v1/chat/completions"
    assert call(two, "POST", chat, {"model": "b"}) == (200, {"by": "b", "model": "b"})
    assert call(two, "POST", chat, {"model": "a"})[1]["by"] == "a"
    status, error = call(two, "POST", chat, {"model": "c"})
    assert status == 404 and "serving a, b" in error["error"]["message"]
    assert call(two, "POST", chat, {"model": "c"}, key="wrong")[0] == 401  # the replica's say
    status, error = call(two, "POST", "/tokenize", {"prompt": "x"})
    assert status == 400 and "several models (a, b)" in error["error"]["message"]
    assert call(two, "POST", chat, {})[1]["by"] == "a"  # the replica says a model is needed
    listed = {"object": "list", "data": [{"id": "a"}, {"id": "b"}]}
    assert call(two, "GET", "/v1/models") == (200, listed)
    assert call(two, "GET", "/v1/models", key="wrong")[0] == 401
    status, health = call(two, "GET", "/health")
    assert status == 200 and set(health["models"]) == {"a", "b"}
    one = Endpoint({"a": _Handle(_model_app("a"))}, [])
    assert call(one, "POST", chat, {"model": "c"}) == (200, {"by": "a", "model": "c"})
    assert call(one, "GET", "/health") == (200, {"status": "ok", "running": 0})


@unit
def test_prefix_router_forgets_replicas_ray_took_away():
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

    from npuw_kv.cluster.router import PrefixRouter

    deployment = DeploymentID("model", "app")

    class Replica:  # what the router reads of Ray's replica wrapper
        def __init__(self, name: str) -> None:
            self.replica_id = ReplicaID(name, deployment)
            self.node_id, self.availability_zone, self.multiplexed_model_ids = "n", None, set()

        async def get_queue_len(self, *, deadline_s: float) -> int:
            return 0

    async def scenario() -> None:
        router = PrefixRouter(deployment, DeploymentHandleSource.UNKNOWN)
        router.initialize_state()
        a, b = Replica("a"), Replica("b")
        router.update_replicas([a, b])
        router.policy.record("a", "x" * 200)
        router.policy.record("b", "y" * 200)
        router.in_flight.update(a=1, b=2)
        router.update_replicas([b])  # a scaled down
        assert set(router.policy.held) == {"b"} and router.in_flight == {"b": 2}
        await asyncio.sleep(0)  # the router's probe of the new replicas

    asyncio.run(scenario())


@unit
def test_auto_device_is_the_npu_where_there_is_one(monkeypatch):
    from npuw_kv.runtime import device

    monkeypatch.setattr(device, "npu_present", lambda: False)
    assert device.resolve_device("auto") == "CPU" and device.resolve_device("NPU") == "NPU"
    monkeypatch.setattr(device, "npu_present", lambda: True)
    assert device.resolve_device("AUTO") == "NPU" and device.resolve_device("CPU") == "CPU"


@unit
@pytest.mark.parametrize(
    "lines, extra, message",
    [
        ("-m smollm2 --port 9000\n", (), "line 1: --port is the endpoint's"),
        ("# none\n\n", (), "lists no model"),
        ("-m a.gguf\n-m b/a.gguf\n", (), "two models served as 'a'"),
        ("-m smollm2\n-m x --replicas 0\n", (), "line 2: --replicas: at least 1"),
        ("-m smollm2 -d GPU\n", (), "line 1: --device must be CPU, NPU or auto"),
        ("-m smollm2 --bogus\n", (), "line 1: unrecognized arguments: --bogus"),
        ("-m smollm2 'open\n", (), "line 1: No closing quotation"),
        ("-m smollm2\n", ("--exact",), "not on the command line (--exact given there)"),
    ],
)
def test_a_models_file_is_checked_before_anything_is_deployed(
    lines, extra, message, tmp_path, capsys
):
    models = tmp_path / "models.txt"
    models.write_text(lines)
    assert main(["serve", "--ray", "--models", str(models), *extra]) == 2
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


def model_replicas(deployment: str = "model") -> list[str]:
    """The Ray actor names of the model deployment's replicas (the driver must be connected)."""
    import ray

    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::") and f"#{deployment}#" in a["name"]
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


@pytest.mark.slow(150)
def test_two_models_on_one_endpoint_scale_up_and_drain(cluster, exact_server):
    """Two models by name behind one endpoint (one on ``-d auto``); the first autoscaled
    1-2 under load, then scaled down to one replica while streams run on both: every stream
    ends whole."""
    import threading

    import ray
    from ray import serve

    from npuw_kv.cli.args import pipeline_kwargs
    from npuw_kv.cli.commands import build_parser
    from npuw_kv.cluster.deployments import ModelPlan, ReplicaSpec, build_app
    from npuw_kv.cluster.launch import free_port

    exact = pipeline_kwargs(build_parser().parse_args(["serve", *EXACT_SERVE_ARGS]))
    smol = ReplicaSpec(None, "genai", "CPU", exact, "smol")
    short = ReplicaSpec(None, "genai", "auto", {**exact, "max_prompt_len": 256}, "short")

    def deploy(smol_replicas: tuple[int, int]) -> None:
        plans = [ModelPlan(smol, smol_replicas, "round-robin", 0.5), ModelPlan(short, (1, 1),
                 "prefix", 0.5)]  # fmt: skip
        scaling = {"upscale_delay_s": 0, "downscale_delay_s": 600, "target_ongoing_requests": 1}
        app = build_app(plans, grace_s=120, autoscaling=scaling)
        serve.run(app, name="two", route_prefix="/", logging_config={"log_level": "WARNING"})

    ray.init(address=cluster.address, namespace="npuw-kv")
    port = free_port("127.0.0.1")
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    try:
        deploy((1, 2))
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-",
                               max_retries=0)  # fmt: skip
        reference = openai.OpenAI(base_url=exact_server.url, api_key="-")
        assert sorted(m.id for m in client.models.list().data) == ["short", "smol"]
        messages = [{"role": "user", "content": "Name three colours."}]
        want = reference.chat.completions.create(
            model=reference.models.list().data[0].id, messages=messages, max_tokens=16,
            temperature=0,
        ).choices[0].message.content  # fmt: skip
        for name in ("smol", "short"):
            got = client.chat.completions.create(
                model=name, messages=messages, max_tokens=16, temperature=0
            )
            assert got.choices[0].message.content == want
        long_prompt = [{"role": "user", "content": "word " * 400}]
        with pytest.raises(openai.BadRequestError, match="256"):  # short's own limit
            client.chat.completions.create(model="short", messages=long_prompt, max_tokens=2)
        assert client.chat.completions.create(
            model="smol", messages=long_prompt, max_tokens=2, extra_body={"ignore_eos": True}
        ).choices[0].finish_reason == "length"  # fmt: skip
        with pytest.raises(openai.NotFoundError, match="serving smol, short"):
            client.chat.completions.create(model="big", messages=messages, max_tokens=2)

        ends: dict[int, tuple[str | None, int]] = {}

        def story(i: int) -> None:
            stream = client.chat.completions.create(
                model="smol", messages=[{"role": "user", "content": f"Tell story {i}."}],
                max_tokens=240, temperature=0, stream=True, extra_body={"ignore_eos": True},
                stream_options={"include_usage": True},
            )  # fmt: skip
            finish, tokens = None, 0
            try:
                for chunk in stream:
                    if chunk.choices:
                        finish = chunk.choices[0].finish_reason or finish
                    if chunk.usage:
                        tokens = chunk.usage.completion_tokens
                ends[i] = (finish, tokens)
            except openai.APIError as exc:
                ends[i] = (f"error {exc}", tokens)

        threads = [threading.Thread(target=story, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while len(model_replicas("model-0")) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)  # three requests in flight against a target of one: a second
        assert len(model_replicas("model-0")) == 2, "smol was not scaled up"
        while serve.status().applications["two"].status != "RUNNING":
            time.sleep(0.5)
        later = [threading.Thread(target=story, args=(i,)) for i in range(3, 5)]
        for t in later:  # round-robin: at least one of them on the new replica
            t.start()
        time.sleep(1.0)
        deploy((1, 1))  # down to one: the replica that goes finishes its streams first
        for t in threads + later:
            t.join(timeout=300)
        assert ends == dict.fromkeys(range(5), ("length", 240)), ends
        deadline = time.monotonic() + 60
        while len(model_replicas("model-0")) > 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(model_replicas("model-0")) == 1
    finally:
        serve.shutdown()
        ray.shutdown()


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
