"""``npuw-kv``: generate, chat, serve, inspect, bench, accuracy, doctor."""

from __future__ import annotations

import argparse
import functools
import os
import sys
import warnings
from pathlib import Path

from .. import __version__
from ..tools.bench_worker import RUNTIMES
from . import terminal as cli_io
from .args import at_least, model_args, pipeline_kwargs, sampling_kwargs, text_args, zero_points_arg
from .chat import chat_session
from .doctor import add_doctor_parser
from .doctor import run as run_doctor  # light: the doctor's sections load when it runs
from .serve_command import add_serve_flags


def _load(args: argparse.Namespace):
    from ..pipeline import LLMPipeline
    from ..runtime.device import npu_present, resolve_device

    args.device = resolve_device(args.device)
    if str(args.device).upper() == "NPU" and not npu_present():
        print(
            "npuw-kv: no NPU here: NPUW runs its sub-models on the CPU (right answers, decoding "
            "several times slower than -d CPU)",
            file=sys.stderr,
        )
    return LLMPipeline(args.model, args.device, **pipeline_kwargs(args))


def cmd_generate(args: argparse.Namespace) -> int:
    pipe = _load(args)
    result = pipe.generate(
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        streamer=cli_io.stdout.write,
        apply_chat_template=not args.no_chat_template,
        **sampling_kwargs(args),
    )
    cli_io.stdout.write("\n")
    stats = f"{len(result.tokens)} tokens, finish={result.finish_reason}, "
    stats += f"TTFT {result.ttft_s * 1000:.0f} ms"
    if len(result.tokens) > 1:  # the rate is over decode steps: none before a second token
        stats += f", {result.ms_per_token:.1f} ms/token"
    print(f"[{stats}]", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    return chat_session(_load(args), args)


def cmd_serve(args: argparse.Namespace) -> int:
    from .serve_command import run_server

    return run_server(args, _load)


def cmd_inspect(args: argparse.Namespace) -> int:
    from ..runtime.device import resolve_device
    from .describe import describe

    print(describe(args.model, resolve_device(args.device), **pipeline_kwargs(args)))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from ..tools.bench import run_bench

    return run_bench(args)


def cmd_doctor(args: argparse.Namespace) -> int:
    return run_doctor(args)


_positive_int = at_least(1)


def _check_inspect(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``inspect MODEL`` is ``inspect -m MODEL``; both, naming different models, is an error."""
    if not args.model_path:
        return
    if args.model is not None and args.model != args.model_path:
        parser.error(
            f"the model is given twice: --model/-m {args.model!r} and MODEL {args.model_path!r}; "
            "give one of them"
        )
    args.model = args.model_path


def _check_bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--quick`` fixes the prompt and the new tokens: an explicit length beside it is an error."""
    from ..tools.bench import QUICK_NEW_TOKENS, QUICK_PROMPT_LEN

    if args.concurrency is not None:
        try:
            levels = [int(n) for n in args.concurrency.split(",") if n.strip()]
        except ValueError:
            levels = []
        if not levels or min(levels) < 1:
            parser.error(
                f"--concurrency takes counts >= 1 such as 1,4,16, got {args.concurrency!r}"
            )
        from ..tools.bench_batch import concurrency_runtimes

        if args.runtimes is not None and args.device is not None:
            parser.error("bench: give either --device or --runtimes, not both")
        try:
            concurrency_runtimes(args.runtimes, args.device)
        except ValueError as exc:
            parser.error(str(exc))
    if args.quick:  # run_bench fills in the lengths left unset
        lengths = (("--prompt-len", args.prompt_len), ("--new-tokens", args.new_tokens))
        given = [option for option, value in lengths if value is not None]
        if given:
            parser.error(
                f"--quick fixes the prompt at ~{QUICK_PROMPT_LEN} tokens and "
                f"{QUICK_NEW_TOKENS} new tokens; drop --quick or {' / '.join(given)}"
            )


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def _str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def cmd_accuracy(args: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401  (the report's plot)
        from tqdm import tqdm
    except ImportError:
        raise SystemExit(
            "npuw-kv accuracy needs tqdm and matplotlib: pip install 'npuw-kv[accuracy]'"
        ) from None

    from ..model.source import resolve_model
    from ..tools.accuracy import report
    from ..tools.accuracy.run import run_matrix

    total = len(args.prompt_lens) * len(args.devices) * len(args.modes) * len(args.chunks)
    bar = tqdm(total=total, desc="accuracy", unit="config", file=sys.stderr)

    def progress(name: str) -> None:
        bar.set_postfix_str(name)
        bar.update(1)

    from ..tools.accuracy.reference import torch_weights

    devices = [d.upper() for d in args.devices]
    torch_source = None if args.no_peer else torch_weights(args.model_source)
    with bar:  # closed (its line ended) on Ctrl-C too
        if args.ray is not None:
            from ..tools.accuracy.on_ray import run_matrix_on_ray

            results = run_matrix_on_ray(
                args.ray, args.model_source, args.gguf_zero_points, args.prompt_lens,
                args.new_tokens, devices, args.modes, args.chunks, progress,
                peer=not args.no_peer, torch_source=torch_source,
            )  # fmt: skip
        else:
            results = run_matrix(
                resolve_model(args.model), args.prompt_lens, args.new_tokens, devices,
                args.modes, args.chunks, progress, peer=not args.no_peer,
                torch_source=torch_source,
            )  # fmt: skip
    print(report.table(results))
    command = "npuw-kv " + " ".join(sys.argv[1:]) if sys.argv[1:] else "npuw-kv accuracy"
    for path in report.write(results, Path(args.out), command):
        print(f"wrote {path}", file=sys.stderr)
    failed = [r.name for r in results if not r.passed]
    if failed:
        print(f"outside tolerance: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="npuw-kv", description=__doc__)
    parser.add_argument("--version", action="version", version=f"npuw-kv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt (streams)")
    model_args(gen)
    text_args(gen, 128)
    gen.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    gen.add_argument("prompt")
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat (REPL)")
    model_args(chat)
    text_args(chat, 256)
    chat.add_argument("--system", default=None, help="system message")
    chat.set_defaults(func=cmd_chat)
    srv = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (needs the serve extra)",
        description="Serve the model over OpenAI's /v1/chat/completions, /v1/completions and "
        "/v1/models (and vLLM's /metrics, /tokenize, /detokenize, /version, and /health) until "
        "Ctrl-C or SIGTERM. On CPU concurrent requests share "
        "batched steps (up to max_num_seqs, set with -p max_num_seqs=N); on NPU they run "
        "one at a time.",
    )
    model_args(srv)
    add_serve_flags(srv)
    srv.set_defaults(func=cmd_serve)
    insp = sub.add_parser("inspect", help="print the discovered KV layout and static shapes")
    model_args(insp)
    insp.add_argument(
        "model_path", nargs="?", default=None, metavar="MODEL", help="same as --model"
    )
    insp.set_defaults(func=cmd_inspect, check=functools.partial(_check_inspect, insp))
    bench = sub.add_parser(
        "bench",
        help="TTFT / decode / peak RSS side by side with openvino-genai",
        description="TTFT / decode / peak RSS side by side with openvino-genai. Prints the "
        "whole table, a failed runtime as a 'failed: ...' row; the exit code is 1 when any "
        "runtime listed failed (npuw-llm fails on the default GGUF model), else 0.",
    )
    model_args(bench, for_bench=True)
    bench.add_argument(
        "--quick",
        action="store_true",
        help="one ~1000-token prompt, 64 new tokens, one timed run after the warm-up (not with "
        "--prompt-len / --new-tokens)",
    )
    bench.add_argument(
        "--prompt-len", type=_positive_int, default=None, help="prompt tokens (default 1000)"
    )
    bench.add_argument(
        "--new-tokens",
        type=at_least(2, " (a decode rate needs a second token)"),
        default=None,
        help="new tokens per run (default 64)",
    )
    bench.add_argument(
        "--repeats",
        type=_positive_int,
        default=None,
        help="timed runs per runtime, the minimum kept (default 3; 1 with --quick)",
    )
    bench.add_argument(
        "--runtimes",
        default=None,
        help=f"comma list of {', '.join(RUNTIMES)} (default: npuw-kv for --device, and genai-cpu)",
    )
    bench.add_argument(
        "--concurrency",
        default=None,
        metavar="N[,N...]",
        help="N prompts submitted together (e.g. 1,4,16): tokens/s over the batch, TTFT p50/p95 "
        "and peak RSS of npuw-kv's CPU path beside genai-cpu (prompts of --prompt-len, "
        "default 190 here)",
    )
    bench.add_argument("--json", default=None, help="also write the results to this file")
    bench.set_defaults(func=cmd_bench, check=functools.partial(_check_bench, bench))
    acc = sub.add_parser("accuracy", help="greedy agreement, |dlogit|, KL, perplexity vs f32 refs")
    acc.add_argument("--model", "-m", default=None, help="IR dir, .gguf, or 'smollm2' (default)")
    acc.add_argument("--prompt-lens", type=_int_list, default=[1024, 4096])
    acc.add_argument("--new-tokens", type=int, default=64)
    acc.add_argument("--devices", type=_str_list, default=["CPU", "NPU"])
    acc.add_argument(
        "--modes",
        type=_str_list,
        default=["exact"],
        help="exact, sdpa (CPU), copy, static, no-pyramid (static models without variants), "
        "pyramid (the full variant ladders), v-transposed, f16-kv, bf16-kv (CPU), "
        "device-default, and the parts of the CPU's defaults u8-kv, u8-kv+dyn-quant, "
        "u8-kv+bf16, bf16-kv+bf16 (docs/accuracy.md)",
    )
    acc.add_argument("--chunks", type=_int_list, default=[256])
    acc.add_argument("--out", default="accuracy-report", help="directory for JSON/Markdown/PNG")
    zero_points_arg(acc)
    acc.add_argument("--no-peer", action="store_true", help="skip the peer runtimes")
    acc.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="run the configurations as Ray tasks on the cluster at ADDRESS (else this "
        "machine's, else a new one): the same report (needs the ray extra; docs/scale-out.md)",
    )
    acc.set_defaults(func=cmd_accuracy)
    add_doctor_parser(sub).set_defaults(func=cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``npuw-kv``; Ctrl-C exits 130 and a closed stdout 141, each without a traceback."""
    return cli_io.run(functools.partial(_main, sys.argv[1:] if argv is None else argv))


def _one_line_warning(message: Warning | str, category: type[Warning], *_: object) -> str:
    warning = message if isinstance(message, Warning) else category(message)
    return f"npuw-kv: warning: {cli_io.one_line(warning)}\n"


def _main(argv: list[str]) -> int:
    warnings.formatwarning = _one_line_warning  # type: ignore[assignment]
    bad = next(filter(None, map(cli_io.undecodable, argv)), None)
    if bad is not None:  # argv bytes the locale could not decode (e.g. Latin-1 under LANG=C)
        cli_io.error(f"argument {bad} is not UTF-8 text")
        return 2
    args = build_parser().parse_args(argv)
    check = getattr(args, "check", None)
    if check is not None:  # cross-option checks: an argparse error (exit code 2) before any work
        check(args)
    try:
        args.model_source = getattr(args, "model", None)
        if getattr(args, "gguf_zero_points", "genai") != "genai":
            # every runtime (ours, the references, bench workers) then reads the same fixed IR
            from ..model.source import resolve_model

            args.model = str(resolve_model(args.model, zero_points=args.gguf_zero_points))
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        hint = ""
        if "MAX_PROMPT_LEN" in str(exc) and hasattr(args, "max_prompt_len"):
            hint = " (on the command line: --max-prompt-len)"
        print(f"npuw-kv: error: {cli_io.one_line(exc)}{hint}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise  # the reader went away: cli_io.run ends quietly
    except Exception as exc:  # nothing we foresaw: one line; the traceback when asked for
        if os.environ.get("NPUW_KV_DEBUG"):
            raise
        cli_io.error(
            f"{type(exc).__name__}: {cli_io.one_line(exc)} (NPUW_KV_DEBUG=1 shows the traceback)"
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
