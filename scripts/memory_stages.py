"""Where peak RSS comes from: anonymous and file-backed memory after each stage of a run.

``npuw-kv bench`` gives one peak number per runtime; this splits it into stages (imports,
load, first prefill chunk, prefill, decode), which is how the CPU memory gap to openvino-genai
was located (README, "Speed and memory").  Each runtime runs in its own process.

    python scripts/memory_stages.py                      # npuw-kv, genai-cpu, genai-sdpa
    python scripts/memory_stages.py npuw-kv ATTENTION_BACKEND=sdpa  # one runtime, + settings

Through the public API only: the "first chunk" stage is the prompt's first prefill chunk run
as a prompt of its own, which the full prompt then continues from the KV cache (prefix reuse;
with ``PREFIX_REUSE=NO`` the full prompt runs that chunk again).  "prefill" is taken when the
first token is streamed, "decode" after ``--new-tokens`` more steps.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Any

RUNTIMES = ("npuw-kv", "genai-cpu", "genai-sdpa")  # the default set
CHOICES = (*RUNTIMES, "npuw-llm")  # every runtime a worker can load


def _mb(key: str) -> int:
    with open("/proc/self/status") as status:
        line = next(x for x in status if x.startswith(key + ":"))
    return int(line.split()[1]) // 1024


def _stage(name: str) -> None:
    anon, file, peak = _mb("RssAnon"), _mb("RssFile"), _mb("VmHWM")
    print(f"  {name:<14} anon {anon:5d} MB  file {file:4d} MB  peak {peak:5d} MB", flush=True)


def _npuw_kv(model: Any, ids: Any, new_tokens: int, properties: dict[str, str]) -> None:
    """Our pipeline, stage by stage; ``new_tokens`` decode steps after the prefill."""
    import openvino_genai

    from npuw_kv import LLMPipeline

    pipe = LLMPipeline(model, "CPU", **properties)  # settings or OpenVINO properties
    _stage("load")
    pipe.generate(ids[: pipe.config.prefill_chunk_size], max_new_tokens=1)
    _stage("first chunk")

    class FirstToken(openvino_genai.StreamerBase):
        """Marks the prefill stage when the first token arrives (before any decode step)."""

        def __init__(self) -> None:
            super().__init__()
            self.seen = False

        def write(self, token: Any) -> openvino_genai.StreamingStatus:
            if not self.seen:
                self.seen = True
                _stage("prefill")
            return openvino_genai.StreamingStatus.RUNNING

        def end(self) -> None:
            pass

    pipe.generate(ids, max_new_tokens=new_tokens + 1, ignore_eos=True, streamer=FirstToken())
    _stage("decode")


def _worker(runtime: str, prompt_len: int, new_tokens: int, properties: dict[str, str]) -> None:
    import numpy as np
    import openvino as ov
    import openvino_genai

    from npuw_kv.model.source import resolve_model
    from npuw_kv.tools.prompts import prompt_ids

    model = resolve_model(None)
    ids = prompt_ids(openvino_genai.Tokenizer(str(model)), prompt_len)
    _stage("imports")
    if runtime == "npuw-kv":
        _npuw_kv(model, ids, new_tokens, properties)
        return
    from npuw_kv.tools.bench_worker import genai_pipeline, genai_properties

    genai = genai_pipeline(runtime, model, genai_properties(properties), 1024, 128)
    _stage("load")
    config = openvino_genai.GenerationConfig()
    config.max_new_tokens, config.ignore_eos = new_tokens, True
    genai.generate(ov.Tensor(np.array([ids], np.int64)), config)
    _stage("generate")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "items",
        nargs="*",
        metavar="RUNTIME|KEY=VALUE",
        help=f"runtimes ({', '.join(CHOICES)}; default {', '.join(RUNTIMES)}) and "
        "settings or OpenVINO properties for them",
    )
    parser.add_argument("--prompt-len", type=int, default=1000, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=64, help="decode steps")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.runtimes = [a for a in args.items if "=" not in a]
    args.properties = [a for a in args.items if "=" in a]
    unknown = [r for r in args.runtimes if r not in CHOICES]
    if unknown:
        parser.error(f"unknown runtime(s) {', '.join(unknown)}; choose from {', '.join(CHOICES)}")
    return args


def main(argv: list[str]) -> None:
    args = parse(argv)
    sizes = ["--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens)]
    if args.worker is not None:
        properties = dict(a.split("=", 1) for a in args.properties)
        _worker(args.worker, args.prompt_len, args.new_tokens, properties)
        return
    for runtime in args.runtimes or RUNTIMES:
        print(runtime, " ".join(args.properties), flush=True)
        worker = [sys.executable, __file__, "--worker", runtime, *sizes, *args.properties]
        subprocess.run(worker, check=True)


if __name__ == "__main__":
    main(sys.argv[1:])
