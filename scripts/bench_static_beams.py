"""Beam search on the CPU's static-shape path: switches stepped on from where beams part
against switches read as prompts.

The static runner holds one sequence, so beams take turns in it
(``npuw_kv/generation/beams_alone.py``).  A beam that parts from the cached one a few tokens
back is stepped on from there (``StaticRunner.truncate``) when that is cheaper than a prefill
chunk; this script times one search each way, in turns, in one process (the "prompts" side
has ``can_truncate`` answer False), and says whether the answers are the same.

    python scripts/bench_static_beams.py [--beams 4] [--new-tokens 32] [--prompt-len 200]
        [--rounds 2] [--exact]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import openvino as ov

from npuw_kv import LLMPipeline
from npuw_kv.config.settings import EXACT_F32
from npuw_kv.runtime.static.runner import StaticRunner
from npuw_kv.tools.prompts import prompt_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--exact", action="store_true", help="f32 compute and KV")
    args = parser.parse_args()
    exact: dict[str, Any] = {**EXACT_F32, "kv_precision": "f32"} if args.exact else {}
    pipe = LLMPipeline(None, "CPU", attention_backend="sdpa", **exact)
    ids = np.asarray(prompt_ids(pipe.tokenizer, args.prompt_len), np.int64)
    pipe.generate(ids, max_new_tokens=4, ignore_eos=True)  # warm-up
    kept: list[int] = []
    truncate, can_truncate = StaticRunner.truncate, StaticRunner.can_truncate

    def counted(runner: StaticRunner, length: int) -> None:
        kept.append(length)
        truncate(runner, length)

    def never(runner: StaticRunner, length: int) -> bool:
        return False

    StaticRunner.truncate = counted  # type: ignore[method-assign,assignment]
    times: dict[str, list[float]] = {"prompts": [], "steps": []}
    answers: dict[str, list[list[list[int]]]] = {"prompts": [], "steps": []}
    for r in range(args.rounds):
        for side in times:
            StaticRunner.can_truncate = can_truncate if side == "steps" else never  # type: ignore[method-assign,assignment]
            kept.clear()
            pipe.runner.forget_prefixes()
            start = time.perf_counter()
            result = pipe.generate(
                ov.Tensor(ids[None]),
                num_beams=args.beams,
                num_return_sequences=args.beams,
                max_new_tokens=args.new_tokens,
            )
            times[side].append(time.perf_counter() - start)
            answers[side].append(result.tokens)
            print(f"{side:8s} round {r}: {times[side][-1]:6.2f} s, {len(kept)} truncates")
    same = answers["prompts"] == answers["steps"]
    ratio = np.mean(times["steps"]) / np.mean(times["prompts"])
    print(f"same answers: {same}; time steps / prompts (means): {ratio:.3f}")


if __name__ == "__main__":
    main()
