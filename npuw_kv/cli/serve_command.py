"""``npuw-kv serve``'s command line: its flags (the model's are the other commands'), and the
server started with them.  The server's packages load only when it starts, so ``npuw-kv
--help`` lists the flags without the ``serve`` extra."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..cluster.affinity import ROUTERS as RAY_ROUTERS  # no Ray: the flags list without it
from ..errors import UsageError
from ..serve.tools import PARSER_SETTING  # no server packages: the flag is listed without them
from . import terminal as cli_io
from .args import at_least

# flags the server honours on uvicorn that Ray Serve's HTTP proxy decides under --ray (refused
# there, not dropped): their defaults, and why
PROXY_FLAGS = {
    "header_timeout": (10.0, "Ray Serve's HTTP proxy holds the connections"),
    "keep_alive_timeout": (5, "Ray Serve's HTTP proxy holds the connections "
                           "(RAY_SERVE_HTTP_KEEP_ALIVE_TIMEOUT_S)"),
    "body_timeout": (30.0, "Ray Serve's HTTP proxy reads the request bodies"),
}  # fmt: skip
# the --ray flags, and their defaults (refused when set without --ray)
_RAY_ONLY: dict[str, Any] = {"replicas": "1", "router": "prefix", "cpus_per_replica": 1.0,
                             "models": None}  # fmt: skip


def add_serve_flags(srv: argparse.ArgumentParser) -> None:
    """The server's own flags."""
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    srv.add_argument(
        "--port",
        type=at_least(0, high=65535),
        default=8000,
        help="port (default 8000; 0: any free one)",
    )
    srv.add_argument(
        "--api-key",
        default=None,
        help="require this Bearer token on every route but /health, /metrics and /version "
        "(default: $NPUW_KV_API_KEY, else none)",
    )
    srv.add_argument(
        "--queue",
        type=at_least(0),
        default=64,
        help="requests that may wait for a turn beyond those running; more get HTTP 429 "
        "(default 64)",
    )
    srv.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send (default: the model file's or folder's name)",
    )
    srv.add_argument(
        "--grace",
        type=at_least(1),
        default=10,
        help="seconds running requests may take to finish after a stop signal (default 10)",
    )
    srv.add_argument("--access-log", action="store_true", help="log every request")
    srv.add_argument(
        "--allowed-hosts",
        action="append",
        default=[],
        metavar="NAMES",
        help="Host header names answered besides the bound address (loopback names when bound "
        "to one; any when bound to 0.0.0.0 and none given); comma-separated or repeated, * any",
    )
    srv.add_argument(
        "--allowed-origins",
        action="append",
        default=[],
        metavar="ORIGINS",
        help="web origins (https://app.example) whose pages may call the server (CORS); "
        "default none; comma-separated or repeated, * any",
    )
    srv.add_argument(
        "--max-body-mb",
        type=positive_float("--max-body-mb"),
        default=4.0,
        help="largest request body in MiB; more gets HTTP 413 (default 4)",
    )
    srv.add_argument(
        "--body-timeout",
        type=positive_float("--body-timeout"),
        default=PROXY_FLAGS["body_timeout"][0],
        help="seconds a request body may take to arrive whole; slower gets 408 (default 30)",
    )
    srv.add_argument(
        "--header-timeout",
        type=positive_float("--header-timeout"),
        default=PROXY_FLAGS["header_timeout"][0],
        help="seconds a connection may take to send a request's headers (default 10)",
    )
    srv.add_argument(
        "--keep-alive-timeout",
        type=at_least(1),
        default=PROXY_FLAGS["keep_alive_timeout"][0],
        help="seconds an idle connection stays open between requests (default 5)",
    )
    srv.add_argument(
        "--chat-template",
        metavar="FILE",
        default=None,
        help="a Jinja chat template to use instead of the model's (e.g. one that renders tools)",
    )
    srv.add_argument(
        "--tool-call-parser",
        choices=PARSER_SETTING,
        default="auto",
        help="the form the model writes tool calls in (default: read from the chat template)",
    )
    ray = srv.add_argument_group("on a Ray cluster (needs the ray extra; docs/scale-out.md)")
    ray.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="serve on Ray Serve: the cluster at ADDRESS (host:port of its head), else the one "
        "this machine runs, else a new one for this command",
    )
    ray.add_argument(
        "--replicas",
        default=_RAY_ONLY["replicas"],
        metavar="N|MIN-MAX",
        help="model replicas, each loading the model (default 1; MIN-MAX: autoscaled)",
    )
    ray.add_argument(
        "--router",
        choices=RAY_ROUTERS,
        default=_RAY_ONLY["router"],
        help="prefix: a request to the replica holding its prompt's prefix unless it is much "
        "busier (default); power-of-two: Ray Serve's own; round-robin: in turn",
    )
    ray.add_argument(
        "--models",
        metavar="FILE",
        default=None,
        help="several models behind one endpoint, chosen by each request's model: FILE has one "
        "line per model, its flags as on this command line (-m, -d, -p, --served-model-name, "
        "--replicas, --router, ...)",
    )
    ray.add_argument(
        "--cpus-per-replica",
        type=positive_float("--cpus-per-replica"),
        default=_RAY_ONLY["cpus_per_replica"],
        help="Ray CPUs each replica reserves (default 1: one replica per CPU Ray counts)",
    )


def api_key_of(given: str | None) -> str | None:
    """``--api-key``, else ``$NPUW_KV_API_KEY``, else none; an empty one given on the command
    line is refused (``--api-key "$KEY"`` with KEY unset would serve without a key)."""
    if given is not None and not given.strip():
        raise UsageError("--api-key is empty (is the variable it came from unset?)")
    return given or os.environ.get("NPUW_KV_API_KEY") or None


def read_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--chat-template {path}: cannot read it ({exc})") from None
    if not text.strip():
        raise UsageError(f"--chat-template {path} is empty")
    return text


def run_server(args: argparse.Namespace, load: Callable[[argparse.Namespace], Any]) -> int:
    """``npuw-kv serve``: the model ``load`` gives, served with the command line's settings."""
    if args.ray is not None:
        from .serve_ray import run_on_ray

        return run_on_ray(args)
    for name, default in _RAY_ONLY.items():
        if getattr(args, name) != default:
            raise UsageError(f"--{name.replace('_', '-')} is for --ray (serving on a Ray cluster)")
    try:
        from ..serve.guard import GuardSettings
        from ..serve.server import serve
    except ModuleNotFoundError as exc:
        cli_io.error(
            f"npuw-kv serve needs the 'serve' extra ({exc.name} is missing): "
            "pip install 'npuw-kv[serve]'"
        )
        return 2
    api_key = api_key_of(args.api_key)  # before the model loads
    template = read_template(args.chat_template)  # before the model loads
    pipe = load(args)
    if template is not None:
        pipe.get_tokenizer().set_chat_template(template)
    live = int(pipe.kv_stats()["max_live_sequences"])
    model_id = args.served_model_name or model_id_of(args.model_source)
    guard = guard_of(args, GuardSettings)
    return serve(
        pipe,
        model_id,
        host=args.host,
        port=args.port,
        live=live,
        queue=args.queue,
        api_key=api_key,
        grace_s=args.grace,
        access_log=args.access_log,
        guard=guard,
        header_timeout_s=args.header_timeout,
        keep_alive_s=args.keep_alive_timeout,
        tool_parser=args.tool_call_parser,
    )


def guard_of(args: argparse.Namespace, settings: Any) -> Any:
    """The server's :class:`~npuw_kv.serve.guard.GuardSettings` (``settings``: the class,
    imported by the caller with the server's packages)."""
    return settings(
        host=args.host,
        allowed_hosts=tuple(listed(args.allowed_hosts)),
        allowed_origins=tuple(listed(args.allowed_origins)),
        max_body_mb=args.max_body_mb,
        body_timeout_s=args.body_timeout,
    )


def listed(given: list[str]) -> list[str]:
    """A repeated, comma-separated option's values."""
    return [part.strip() for value in given for part in value.split(",") if part.strip()]


def model_id_of(model: str | None) -> str:
    """The name clients use for the model: the shipped model's, or the file's / folder's."""
    from ..model.source import DEFAULT_MODEL

    if not model:
        return DEFAULT_MODEL
    path = Path(model)
    return path.stem if path.suffix.lower() == ".gguf" else (path.name or str(model))


def positive_float(name: str) -> Callable[[str], float]:
    """An argparse type: a finite number above 0."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"{name} must be above 0, got {text}")
        return value

    return parse
