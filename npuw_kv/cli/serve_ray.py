"""``npuw-kv serve --ray``: the models to serve, from the command line or, for several behind
one endpoint, from ``--models FILE`` (one line per model, its flags as on the command line),
checked before anything is deployed."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import NoReturn

from ..errors import UsageError
from . import terminal as cli_io
from .args import model_args, pipeline_kwargs
from .serve_command import (
    PROXY_FLAGS,
    add_serve_flags,
    api_key_of,
    guard_of,
    model_id_of,
    read_template,
)

# the flags a --models line may set: the model's and its replicas' (the rest are the endpoint's)
_MODEL_LINE_FLAGS = (
    "queue", "served_model_name", "chat_template", "tool_call_parser", "replicas", "router",
    "cpus_per_replica",
)  # fmt: skip
_DEVICES = ("CPU", "NPU", "AUTO")


def run_on_ray(args: argparse.Namespace) -> int:
    """Replicas on a Ray cluster, each loading its model itself (a model file's path must be
    the same on every machine)."""
    try:
        from ..cluster.deployments import ModelPlan, ReplicaSpec, parse_replicas
        from ..cluster.launch import serve_on_ray
        from ..serve.guard import GuardSettings
    except ModuleNotFoundError as exc:
        cli_io.error(
            f"npuw-kv serve --ray needs the 'ray' extra ({exc.name} is missing): "
            "pip install 'npuw-kv[ray]'"
        )
        return 2
    for name, (default, why) in PROXY_FLAGS.items():
        if getattr(args, name) != default:
            raise UsageError(f"--{name.replace('_', '-')} is not used with --ray: {why}")
    lines = [("", args)] if args.models is None else models_file(args.models, args)
    api_key, guard = api_key_of(args.api_key), guard_of(args, GuardSettings)
    plans = []
    for where, line in lines:
        try:
            replicas = parse_replicas(line.replicas)
        except ValueError as exc:
            raise UsageError(f"{where}{exc}") from None
        if str(line.device).upper() not in _DEVICES:
            raise UsageError(f"{where}--device must be CPU, NPU or auto, got {line.device!r}")
        model = line.model_source  # each replica resolves it (a fixed IR is made on its machine)
        if model and Path(model).exists():
            model = str(Path(model).resolve())  # the replicas do not share this directory
        spec = ReplicaSpec(
            model=model,
            zero_points=line.gguf_zero_points,
            device=line.device,
            pipeline=pipeline_kwargs(line),
            model_id=line.served_model_name or model_id_of(line.model_source),
            queue=line.queue,
            api_key=api_key,
            guard=guard,
            tool_parser=line.tool_call_parser,
            chat_template=read_template(line.chat_template),
        )
        plans.append(ModelPlan(spec, replicas, line.router, line.cpus_per_replica))
    names = [plan.spec.model_id for plan in plans]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UsageError(f"--models {args.models}: two models served as {twice[0]!r}: give "
                         "each line its own --served-model-name")  # fmt: skip
    return serve_on_ray(
        plans,
        address=args.ray,
        host=args.host,
        port=args.port,
        grace_s=args.grace,
        access_log=args.access_log,
    )


def models_file(path: str, args: argparse.Namespace) -> list[tuple[str, argparse.Namespace]]:
    """The models ``--models FILE`` lists, one per line (blank lines and ``#`` comments
    skipped), each with where it was ("--models FILE, line N: ", for messages): each line
    parsed as ``npuw-kv serve``'s flags would be, and refused if it sets one of the endpoint's
    or the command line sets one of a model's."""
    blank = vars(_line_parser("npuw-kv serve").parse_args([]))
    ours = _model_flags()
    given = [name for name, value in blank.items()
             if name in ours and getattr(args, name, value) != value]  # fmt: skip
    if given:
        raise UsageError(f"--models {path}: the models' flags go on its lines, not on the "
                         f"command line (--{given[0].replace('_', '-')} given there)")  # fmt: skip
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--models {path}: cannot read it ({exc})") from None
    lines = []
    for number, raw in enumerate(text.splitlines(), 1):
        try:
            words = shlex.split(raw, comments=True)
        except ValueError as exc:
            raise UsageError(f"--models {path}, line {number}: {exc}") from None
        if not words:
            continue
        where = f"--models {path}, line {number}: "
        line = _line_parser(where[:-2]).parse_args(words)
        theirs = [n for n, value in blank.items() if n not in ours and getattr(line, n) != value]
        if theirs:
            flag = "--" + theirs[0].replace("_", "-")
            raise UsageError(f"{where}{flag} is the endpoint's: give it on the command line")
        line.model_source = line.model
        lines.append((where, line))
    if not lines:
        raise UsageError(f"--models {path} lists no model (one line per model)")
    return lines


def _model_flags() -> set[str]:
    """The destinations a ``--models`` line may set: the model's and its replicas'."""
    probe = argparse.ArgumentParser(add_help=False)
    model_args(probe)
    return set(vars(probe.parse_args([]))) | set(_MODEL_LINE_FLAGS)


class _LineParser(argparse.ArgumentParser):
    """A ``--models`` line's parser: errors raised (naming the line), not exits."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def _line_parser(prog: str) -> argparse.ArgumentParser:
    parser = _LineParser(prog=prog, add_help=False)
    model_args(parser)
    add_serve_flags(parser)
    return parser
