#!/usr/bin/env python3
"""Speculative decoding side by side: plain decoding, a draft's chain, and its trees.

One plain pipeline and one with ``--draft`` (default: the model itself, which guesses every
token right: the figure is then what speculation costs, not what it saves), greedy with
``ignore_eos``, the configurations alternating ``--runs`` times.  Printed per configuration:
ms per answer token (best and median over the runs), main-model calls per prompt and the
acceptance rate.

    python scripts/bench_speculative.py                    # the default model as its own draft
    python scripts/bench_speculative.py -m BIG --draft SMALL --trees 4x2x8,3x3x10
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from npuw_kv import LLMPipeline, draft_model
from npuw_kv.model.source import resolve_model

PROMPTS = (
    "Write a short story about a robot learning to paint.",
    "Explain how a hash map works, with an example in Python.",
    "List ten facts about the Moon.",
)


def tree(text: str) -> dict[str, int]:
    """``DEPTHxBRANCHINGxNODES`` -> the generation config's tree search fields."""
    depth, branching, nodes = (int(part) for part in text.split("x"))
    return {"tree_depth": depth, "branching_factor": branching, "num_assistant_tokens": nodes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", default=None)
    parser.add_argument("--draft", default=None, help="the draft model (default: the model)")
    parser.add_argument("--chain", type=int, default=4, help="num_assistant_tokens of the chain")
    parser.add_argument("--trees", default="4x2x8,3x3x10", help="DEPTHxBRANCHINGxNODES,...")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    model = resolve_model(args.model)
    draft = resolve_model(args.draft) if args.draft else model
    plain = LLMPipeline(model, "CPU")
    spec = LLMPipeline(model, "CPU", draft_model=draft_model(draft, "CPU"))
    configs: dict[str, tuple[Any, dict[str, int]]] = {
        "plain": (plain, {}),
        f"chain {args.chain}": (spec, {"num_assistant_tokens": args.chain}),
    }
    for shape in filter(None, args.trees.split(",")):
        configs[f"tree {shape}"] = (spec, tree(shape))
    ms: dict[str, list[float]] = {name: [] for name in configs}
    calls: dict[str, list[int]] = {name: [] for name in configs}
    rates: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.runs):
        for name, (pipe, fields) in configs.items():
            start = time.perf_counter()
            for prompt in PROMPTS:
                pipe.generate(prompt, max_new_tokens=args.new_tokens, ignore_eos=True, **fields)
                stats = pipe.kv_stats().get("speculative") if fields else None
                calls[name].append(stats["verify_calls"] + 1 if stats else args.new_tokens)
                rates[name].append(stats["acceptance_rate"] if stats else 0.0)
            ms[name].append((time.perf_counter() - start) * 1000 / args.new_tokens / len(PROMPTS))
    print(f"model {model.name}, draft {draft.name}, {args.new_tokens} tokens x {len(PROMPTS)}")
    for name in configs:
        print(
            f"{name:14s} ms/token best {min(ms[name]):6.2f} median "
            f"{statistics.median(ms[name]):6.2f}   main calls/prompt "
            f"{statistics.mean(calls[name]):5.1f}   accepted {statistics.mean(rates[name]):.2f}"
        )


if __name__ == "__main__":
    main()
