"""The Ray Serve application of ``npuw-kv serve --ray``: an endpoint deployment that relays
each HTTP request to a model replica chosen by :class:`~.router.PrefixRouter`, the model
replicas (each one npuw-kv pipeline behind the server's own application), and a small actor
where the replicas leave their ``/metrics`` for the endpoint to merge."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import ReplicaUnavailableError
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..serve.api_error import ApiError, error_response, sse
from ..serve.guard import GuardSettings
from .affinity import ROUTERS, prompt_text
from .forward import Forwarded, drive
from .metrics_merge import merge_metrics

PUSH_S = 1.0  # how often a replica leaves its metrics on the board
STALE_S = 30.0  # a replica silent this long is left out of /metrics (it died)
RETRIES = 1  # a request whose replica died before it answered is sent once more
REPLICA_GONE = (RayActorError, ActorUnavailableError, ReplicaUnavailableError)


@dataclass(frozen=True)
class ReplicaSpec:
    """What every model replica is built from (sent to each node, so plain values only)."""

    model: str | None
    zero_points: str
    device: str
    pipeline: dict[str, Any]
    model_id: str
    queue: int = 64
    api_key: str | None = None
    guard: GuardSettings = field(default_factory=GuardSettings)
    tool_parser: str = "auto"
    chat_template: str | None = None

    @property
    def board_name(self) -> str:
        return f"npuw-kv-metrics:{self.model_id}"


class _MetricsBoard:
    """The replicas' latest ``/metrics`` texts (a replica cannot be asked directly: Ray Serve
    routes each call to one replica of its choice)."""

    def __init__(self) -> None:
        self.texts: dict[str, tuple[str, float]] = {}

    def put(self, replica: str, text: str) -> None:
        self.texts[replica] = (text, time.time())

    def drop(self, replica: str) -> None:
        self.texts.pop(replica, None)

    def read(self, max_age_s: float) -> dict[str, str]:
        now = time.time()
        return {r: text for r, (text, at) in self.texts.items() if now - at <= max_age_s}


MetricsBoard: Any = ray.remote(num_cpus=0)(_MetricsBoard)


def board(name: str) -> Any:
    """The metrics board of one application, made by whoever asks first (it lives as long as
    that one: a replica that outlives it makes another)."""
    return MetricsBoard.options(name=name, namespace="npuw-kv", get_if_exists=True).remote()


class ModelReplica:
    """One npuw-kv pipeline serving the application ``npuw-kv serve`` serves."""

    def __init__(self, spec: ReplicaSpec) -> None:
        from ..model.source import resolve_model
        from ..pipeline import LLMPipeline
        from ..serve.app import make_app

        model = spec.model
        if spec.zero_points != "genai":  # as the command line does: the fixed IR, made here
            model = str(resolve_model(model, zero_points=spec.zero_points))
        self.pipe = LLMPipeline(model, spec.device, **spec.pipeline)
        if spec.chat_template is not None:
            self.pipe.get_tokenizer().set_chat_template(spec.chat_template)
        live = int(self.pipe.kv_stats()["max_live_sequences"])
        self.app = make_app(self.pipe, spec.model_id, live, spec.queue, spec.api_key,
                            guard=spec.guard, tool_parser=spec.tool_parser)  # fmt: skip
        self.name = serve.get_replica_context().replica_id.unique_id
        self.board_name = spec.board_name
        self.stopped = threading.Event()
        threading.Thread(target=self._push, name="npuw-kv-metrics", daemon=True).start()

    async def forward(self, request: Forwarded) -> Any:
        async for message in drive(self.app, request):
            yield message

    def _push(self) -> None:
        """Leave this replica's metrics on the board every ``PUSH_S``."""
        target = None
        while not self.stopped.wait(PUSH_S):
            try:
                target = target or board(self.board_name)
                text = self.app.state.metrics.render().decode()
                ray.get(target.put.remote(self.name, text), timeout=PUSH_S * 5)
            except Exception:  # noqa: BLE001 - the board died with its maker: make another
                target = None

    def __del__(self) -> None:
        self.stopped.set()
        app = getattr(self, "app", None)
        if app is not None:  # Ray Serve's graceful stop: what still runs is cut short
            app.state.stop_requests()
            app.state.worker.stop()


class Endpoint:
    """The HTTP side: every request relayed to a model replica, ``/metrics`` merged."""

    def __init__(self, model: Any, board_name: str) -> None:
        self.model, self.board_name = model, board_name

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if path == "/metrics" and request.method == "GET":
            from ..serve.metrics import CONTENT_TYPE  # with its package: only when asked

            texts = await board(self.board_name).read.remote(STALE_S)
            return Response(merge_metrics(texts), media_type=CONTENT_TYPE)
        body = await request.body()
        client = request.scope.get("client")
        forwarded = Forwarded(
            method=request.method,
            path=path,
            query=request.scope.get("query_string", b""),
            headers=tuple((k, v) for k, v in request.scope["headers"]),
            body=body,
            client=tuple(client) if client else None,
            key=prompt_text(path, body),
        )
        return await relay(self.model, forwarded)


async def relay(model: Any, forwarded: Forwarded) -> Response:
    """The replica's answer to ``forwarded``: a stream relayed as it comes, any other answer
    whole.  A replica that dies before the answer left is replaced by another (once)."""
    for attempt in range(RETRIES + 1):
        stream = model.options(stream=True).forward.remote(forwarded)
        try:
            start = await stream.__anext__()
            if _is_event_stream(start):
                return _Relay(start, stream)
            return _Whole(start, [m async for m in stream])
        except REPLICA_GONE:
            stream.cancel()
            if attempt == RETRIES:
                break
    return error_response(_GONE_BEFORE)


def _is_event_stream(start: dict[str, Any]) -> bool:
    headers = dict(start.get("headers", ()))
    return headers.get(b"content-type", b"").startswith(b"text/event-stream")


class _Whole(Response):
    """ASGI messages sent as they were received (the answer already whole)."""

    def __init__(self, start: dict[str, Any], body: list[dict[str, Any]]) -> None:
        self.start, self.body_messages = start, body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(self.start)
        for message in self.body_messages:
            await send(message)
        if not self.body_messages or self.body_messages[-1].get("more_body"):
            await send({"type": "http.response.body", "body": b"", "more_body": False})


class _Relay(Response):
    """A server-sent-event stream relayed piece by piece; if its replica dies mid-stream the
    stream ends with an error event and ``[DONE]`` (the client raises: nothing is cut
    silently); if the client leaves, the replica's request is cancelled."""

    def __init__(self, start: dict[str, Any], stream: Any) -> None:
        self.start, self.stream = start, stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        finished = False
        try:
            await send(self.start)
            async for message in self.stream:
                await send(message)
            finished = True
        except REPLICA_GONE:
            await send({"type": "http.response.body", "body": _CUT_EVENTS, "more_body": False})
            finished = True
        finally:
            if not finished:
                self.stream.cancel()


_GONE_BEFORE = ApiError(
    503, "the replica serving this request stopped before it answered, and so did its retry; "
    "try again", kind="server_error", code="replica_unavailable",
)  # fmt: skip
_CUT = ApiError(
    503, "the replica serving this answer stopped mid-stream: the answer is cut short",
    kind="server_error", code="replica_died",
)  # fmt: skip
_CUT_EVENTS = (sse(_CUT.body()) + "data: [DONE]\n\n").encode()


def parse_replicas(text: str) -> tuple[int, int]:
    """``--replicas``: ``N`` (fixed) or ``MIN-MAX`` (autoscaled on requests in flight)."""
    low, sep, high = text.partition("-")
    try:
        lo, hi = int(low), int(high) if sep else int(low)
    except ValueError:
        raise ValueError(f"--replicas takes N or MIN-MAX, got {text!r}") from None
    if lo < 1 or hi < lo:
        raise ValueError(f"--replicas: at least 1, and MIN <= MAX, got {text!r}")
    return lo, hi


def build_app(
    spec: ReplicaSpec,
    *,
    replicas: tuple[int, int] = (1, 1),
    router: str = "prefix",
    cpus_per_replica: float = 1.0,
    grace_s: float = 10.0,
    max_ongoing: int | None = None,
) -> Any:
    """The Serve application: ``replicas`` (MIN, MAX) model replicas routed by ``router``.
    ``max_ongoing``: requests Ray lets one replica hold (default: its ``--queue`` and 64 more
    for those running, so the replica's own admission answers 429, as a single server's)."""
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    options: dict[str, Any] = dict(
        name="model",
        max_ongoing_requests=max_ongoing or spec.queue + 64,
        ray_actor_options={"num_cpus": cpus_per_replica},
        graceful_shutdown_timeout_s=grace_s,
        max_constructor_retry_count=2,  # a model that did not load twice will not: say so
    )
    if replicas[0] == replicas[1]:
        options["num_replicas"] = replicas[0]
    else:
        options["autoscaling_config"] = {"min_replicas": replicas[0], "max_replicas": replicas[1],
                                         "target_ongoing_requests": 4}  # fmt: skip
    if router != "power-of-two":
        chosen = "PrefixRouter" if router == "prefix" else "RoundRobinRouter"
        options["request_router_config"] = {
            "request_router_class": f"{__package__}.router.{chosen}"
        }
    model = serve.deployment(**options)(ModelReplica)
    endpoint = serve.deployment(
        name="endpoint",
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=10_000,
        graceful_shutdown_timeout_s=grace_s,
    )(Endpoint)
    return endpoint.bind(model.bind(spec), spec.board_name)
