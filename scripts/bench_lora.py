#!/usr/bin/env python3
"""What registering a LoRA adapter costs: time to first token, time per token, switching.

One pipeline without adapters and one with a random adapter (``--rank``, every q/k/v/o and MLP
projection, built by ``models/make_lora_adapter.py`` for the model) registered, side by side in
one run, alternating; greedy with ``ignore_eos``.  The adapted pipeline runs with alpha 1 and
with alpha 0 (the base model through the same graph); the switch between them is timed too
(the call after a switch prefills again: no KV is reused across adapters).

    python scripts/bench_lora.py                    # the default model, CPU default path
    python scripts/bench_lora.py -d NPU --rank 16
    python scripts/bench_lora.py -m IR --genai      # openvino-genai beside it (an optimum IR:
                                                    # genai matches layers by name only)

With ``--genai`` openvino-genai's pipeline runs the same way without and with the adapter
(its prefix cache may serve the repeated prompt, so its TTFT is not comparable; TPOT is).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from npuw_kv import Adapter, AdapterConfig, LLMPipeline
from npuw_kv.model.source import resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from make_lora_adapter import make_lora_adapter  # noqa: E402

PROMPT = "Explain in detail how a CPU cache works, level by level. " * 12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", default=None)
    parser.add_argument("-d", "--device", default="CPU")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--genai", action="store_true", help="openvino-genai beside it")
    args = parser.parse_args()
    model = resolve_model(args.model)
    tmp = tempfile.TemporaryDirectory()
    path = make_lora_adapter(model, Path(tmp.name) / "adapter.safetensors", rank=args.rank)
    adapter = Adapter(path)
    base = LLMPipeline(model, args.device)
    lora = LLMPipeline(model, args.device, adapters=AdapterConfig(adapter, 1.0))
    on, off = AdapterConfig(adapter, 1.0), AdapterConfig()
    runs: dict[str, list[tuple[float, float]]] = {"base": [], "alpha 1": [], "alpha 0": []}
    switches = []

    def call(pipe: Any, **kwargs: object) -> tuple[float, float]:
        # prefix reuse off for the measurement: every call runs its whole prompt
        result = pipe.generate(
            [PROMPT], max_new_tokens=args.new_tokens, ignore_eos=True, apply_chat_template=False,
            **kwargs,
        )  # fmt: skip
        metrics = result.perf_metrics
        return metrics.get_ttft().mean, metrics.get_tpot().mean

    peers: dict[str, Any] = {}
    if args.genai:
        import openvino_genai

        theirs = openvino_genai.AdapterConfig(openvino_genai.Adapter(str(path)), 1.0)
        peers["genai"] = openvino_genai.LLMPipeline(str(model), args.device)
        peers["genai+lora"] = openvino_genai.LLMPipeline(str(model), args.device, adapters=theirs)
        runs.update({name: [] for name in peers})
    for pipe in (base, lora, *peers.values()):  # warm up
        call(pipe)
    for _ in range(args.repeats):
        base.runner.forget_prefixes()
        runs["base"].append(call(base))
        started = time.perf_counter()
        engine = lora.engine
        engine.use_adapters(engine.lora.alphas(on) if engine.lora else None)
        switches.append(1000 * (time.perf_counter() - started))
        lora.runner.forget_prefixes()
        runs["alpha 1"].append(call(lora, adapters=on))
        lora.runner.forget_prefixes()
        runs["alpha 0"].append(call(lora, adapters=off))
        for name, pipe in peers.items():
            runs[name].append(call(pipe))
    ttft0 = statistics.median(t for t, _ in runs["base"])
    tpot0 = statistics.median(p for _, p in runs["base"])
    print(f"model {model.name}, {args.device}, adapter rank {args.rank} on every projection")
    for name, values in runs.items():
        ttft = statistics.median(t for t, _ in values)
        tpot = statistics.median(p for _, p in values)
        print(
            f"{name:10s} TTFT {ttft:7.1f} ms ({ttft / ttft0:.2f}x)   "
            f"TPOT {tpot:6.2f} ms ({tpot / tpot0:.2f}x)"
        )
    print(f"switch (writing the alpha input, dropping cached prefixes): "
          f"{statistics.median(switches):.2f} ms median")  # fmt: skip


if __name__ == "__main__":
    main()
