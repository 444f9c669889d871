"""``npuw-kv serve --ray``: the application deployed on a Ray cluster, its URL printed once
every replica has loaded its model, and taken down (replicas given ``grace_s`` to finish what
they run) on Ctrl-C or SIGTERM, exit code 0.  Only this application is deleted: other Serve
applications on the cluster, and the cluster itself, stay."""

from __future__ import annotations

import signal
import socket
import sys
import threading
from types import FrameType
from typing import Any

from .deployments import ModelPlan, app_name, build_app


def free_port(host: str) -> int:
    """A port free on ``host`` now (Ray Serve's proxy takes a fixed port, not 0)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def serve_on_ray(
    plans: list[ModelPlan],
    *,
    address: str | None,
    host: str,
    port: int,
    grace_s: float,
    access_log: bool,
) -> int:
    """Serve the models of ``plans`` behind one endpoint on the cluster at ``address`` (None:
    the one this machine runs, or a new one for this process) until stopped; the exit code."""
    import ray
    from ray import serve

    stop = threading.Event()

    def on_signal(sig: int, frame: FrameType | None) -> None:
        stop.set()

    ray.init(address=address or None, namespace="npuw-kv", log_to_driver=access_log)
    ours = not _serve_running(serve)  # Serve started here is shut down here when left empty
    try:
        port = port or free_port(host)
        serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port})
        app, name = build_app(plans, grace_s=grace_s), app_name(plans)
        level = "INFO" if access_log else "WARNING"
        try:
            serve.run(app, name=name, route_prefix="/",
                      logging_config={"log_level": level})  # fmt: skip
            problem = "" if _proxy_answers(host, port) else _OTHER_PROXY.format(host, port)
        except (RuntimeError, KeyboardInterrupt) as exc:  # nothing is served: leave nothing
            if isinstance(exc, KeyboardInterrupt):
                _take_down(serve, name, ours)
                return 130
            problem = "the replicas did not start: " + (_replica_error(serve, name) or str(exc))
        if problem:
            _take_down(serve, name, ours)
            print(f"npuw-kv: error: {problem}", file=sys.stderr)
            return 1
        for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which sets its own
            signal.signal(sig, on_signal)
        shown = f"[{host}]" if ":" in host else host
        print(f"npuw-kv serve: listening on http://{shown}:{port}/v1 ({_served(plans)} on Ray; "
              "Ctrl-C stops)", flush=True)  # fmt: skip
        while not stop.wait(0.5):
            pass
        _take_down(serve, name, ours)  # waits for the replicas' graceful stop
    finally:
        ray.shutdown()
    return 0


_OTHER_PROXY = (
    "Ray Serve already runs on this cluster, its HTTP proxy elsewhere than {}:{} (the options "
    "of the first Serve application hold): give that address with --host/--port, or stop it "
    "with `serve shutdown`"
)


def _served(plans: list[ModelPlan]) -> str:
    """What the endpoint serves, as the start-up line says it."""
    parts = []
    for plan in plans:
        low, high = plan.replicas
        count = f"{low}" if low == high else f"{low}-{high}"
        parts.append(f"{plan.spec.model_id}: {count} replicas, {plan.router} routing")
    return "; ".join(parts)


def _serve_running(serve: Any) -> bool:
    return bool(serve.status().proxies)


def _proxy_answers(host: str, port: int, wait_s: float = 15.0) -> bool:
    """Whether Ray Serve's proxy on ``host:port`` serves (its health route answers 200; it
    says 503 until its route table has the application)."""
    import time
    import urllib.request

    target = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
    target = f"[{target}]" if ":" in target else target
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with urllib.request.urlopen(f"http://{target}:{port}/-/healthz", timeout=5) as reply:
                return bool(reply.status == 200)
        except OSError:  # refused, or an HTTP error before the routes are in
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)


def _take_down(serve: Any, name: str, ours: bool) -> None:
    """Delete the application; and Serve itself when this command started it and nothing else
    runs on it."""
    serve.delete(name)
    if ours and not serve.status().applications:
        serve.shutdown()


def _replica_error(serve: Any, name: str) -> str:
    """The last line of what the model deployment reported (a replica's exception)."""
    try:
        deployments = serve.status().applications[name].deployments
    except (KeyError, AttributeError):
        return ""
    lines = [line.strip() for d in deployments.values() for line in d.message.splitlines()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or [""])[-1]
