"""Where peak RSS comes from: anonymous and file-backed memory after each stage of a run.

``npuw-kv bench`` gives one peak number per runtime; this splits it into stages (imports,
load, first prefill chunk, prefill, decode), which is how the CPU memory gap to openvino-genai
was located (README, "Speed and memory").  Each runtime runs in its own process.

    python scripts/memory_stages.py                      # npuw-kv, genai-cpu, genai-sdpa
    python scripts/memory_stages.py npuw-kv ATTENTION_BACKEND=sdpa  # one runtime, + settings
"""

from __future__ import annotations

import subprocess
import sys

RUNTIMES = ("npuw-kv", "genai-cpu", "genai-sdpa")
PROMPT, NEW_TOKENS = 1000, 64


def _mb(key: str) -> int:
    with open("/proc/self/status") as status:
        line = next(x for x in status if x.startswith(key + ":"))
    return int(line.split()[1]) // 1024


def _stage(name: str) -> None:
    anon, file, peak = _mb("RssAnon"), _mb("RssFile"), _mb("VmHWM")
    print(f"  {name:<14} anon {anon:5d} MB  file {file:4d} MB  peak {peak:5d} MB", flush=True)


def _worker(runtime: str, properties: dict[str, str]) -> None:
    import numpy as np
    import openvino as ov
    import openvino_genai

    from npuw_kv.model.source import resolve_model
    from npuw_kv.prompts import prompt_ids

    model = resolve_model(None)
    ids = prompt_ids(openvino_genai.Tokenizer(str(model)), PROMPT)
    _stage("imports")
    if runtime == "npuw-kv":
        from npuw_kv import LLMPipeline

        pipe = LLMPipeline(model, "CPU", **properties)  # settings or OpenVINO properties
        _stage("load")
        chunks: list[int] = []

        def after_chunk(*_: object) -> None:
            chunks.append(1)
            if len(chunks) == 1:
                _stage("first chunk")

        pipe.runner.prefill(ids, on_chunk=after_chunk)
        _stage("prefill")
        for _ in range(NEW_TOKENS):
            pipe.runner.step(5)
        _stage("decode")
        return
    from npuw_kv.bench import genai_pipeline, genai_properties

    genai = genai_pipeline(runtime, model, genai_properties(properties), 1024, 128)
    _stage("load")
    config = openvino_genai.GenerationConfig()
    config.max_new_tokens, config.ignore_eos = NEW_TOKENS, True
    genai.generate(ov.Tensor(np.array([ids], np.int64)), config)
    _stage("generate")


def main(argv: list[str]) -> None:
    if argv[:1] == ["--worker"]:
        _worker(argv[1], dict(a.split("=", 1) for a in argv[2:]))
        return
    runtimes = [a for a in argv if "=" not in a] or list(RUNTIMES)
    properties = [a for a in argv if "=" in a]
    for runtime in runtimes:
        print(runtime, " ".join(properties))
        subprocess.run([sys.executable, __file__, "--worker", runtime, *properties], check=True)


if __name__ == "__main__":
    main(sys.argv[1:])
