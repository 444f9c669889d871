"""The Ray Serve application of ``npuw-kv serve --ray``: one deployment per model, whose
replicas each run one npuw-kv pipeline behind the server's own application, routed among by
:class:`~.router.PrefixRouter` (or another of :data:`~.affinity.ROUTERS`), and the endpoint
deployment (:mod:`.endpoint`) in front of them all."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import serve

from ..serve.guard import GuardSettings
from .affinity import ROUTERS
from .board import PUSH_S, board
from .endpoint import Endpoint
from .forward import Forwarded, drive


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


class ModelReplica:
    """One npuw-kv pipeline serving the application ``npuw-kv serve`` serves."""

    def __init__(self, spec: ReplicaSpec) -> None:
        from ..model.source import resolve_model
        from ..pipeline import LLMPipeline
        from ..runtime.device import resolve_device
        from ..serve.app import make_app

        model = spec.model
        if spec.zero_points != "genai":  # as the command line does: the fixed IR, made here
            model = str(resolve_model(model, zero_points=spec.zero_points))
        device = resolve_device(spec.device)  # "auto": this machine's NPU, else its CPU
        self.pipe = LLMPipeline(model, device, **spec.pipeline)
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


@dataclass(frozen=True)
class ModelPlan:
    """One model of the application: its replicas' spec, how many (MIN, MAX: autoscaled on
    requests in flight when they differ), how requests are routed among them, and the Ray
    CPUs each reserves."""

    spec: ReplicaSpec
    replicas: tuple[int, int] = (1, 1)
    router: str = "prefix"
    cpus_per_replica: float = 1.0

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {self.router!r}")


def app_name(plans: list[ModelPlan]) -> str:
    """The Serve application's name: its models' names."""
    return "+".join(plan.spec.model_id for plan in plans)


def build_app(
    plans: list[ModelPlan],
    *,
    grace_s: float = 10.0,
    max_ongoing: int | None = None,
    autoscaling: dict[str, Any] | None = None,
) -> Any:
    """The Serve application: an endpoint over one deployment per plan.  ``max_ongoing``:
    requests Ray lets one replica hold (default: its ``--queue`` and 64 more for those
    running, so the replica's own admission answers 429, as a single server's);
    ``autoscaling``: Ray Serve autoscaling options over ours (its delays, say)."""
    names = [plan.spec.model_id for plan in plans]
    if not plans or len(set(names)) != len(names):
        raise ValueError(f"each model needs a name of its own, got {names}")
    models = {}
    for i, plan in enumerate(plans):
        spec = plan.spec
        options: dict[str, Any] = dict(
            name="model" if len(plans) == 1 else f"model-{i}",
            max_ongoing_requests=max_ongoing or spec.queue + 64,
            ray_actor_options={"num_cpus": plan.cpus_per_replica},
            graceful_shutdown_timeout_s=grace_s,
            max_constructor_retry_count=2,  # a model that did not load twice will not: say so
        )
        low, high = plan.replicas
        if low == high:
            options["num_replicas"] = low
        else:
            options["autoscaling_config"] = {
                "min_replicas": low,
                "max_replicas": high,
                "target_ongoing_requests": 4,
                **(autoscaling or {}),
            }
        if plan.router != "power-of-two":
            chosen = "PrefixRouter" if plan.router == "prefix" else "RoundRobinRouter"
            options["request_router_config"] = {
                "request_router_class": f"{__package__}.router.{chosen}"
            }
        models[spec.model_id] = serve.deployment(**options)(ModelReplica).bind(spec)
    endpoint = serve.deployment(
        name="endpoint",
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=10_000,
        graceful_shutdown_timeout_s=grace_s,
    )(Endpoint)
    return endpoint.bind(models, [plan.spec.board_name for plan in plans])
