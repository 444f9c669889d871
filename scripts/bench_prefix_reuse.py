"""TTFT of a chat turn whose start is still in the KV cache: reused vs from scratch.

A 400-token prompt is answered (32 tokens), then a turn of that prompt, its answer and 60 new
tokens is timed twice in the same pipeline: with ``prefix_reuse`` (only the rest runs) and
without it (every chunk).  Best of 3 after a warm-up; both sides in one process, so compare
the ratio.

    python scripts/bench_prefix_reuse.py
"""

from __future__ import annotations

import numpy as np

from npuw_kv import LLMPipeline
from npuw_kv.prompts import prompt_ids

FIRST, NEW = 400, 60


def main() -> None:
    pipe = LLMPipeline(None, "CPU")
    text = prompt_ids(pipe.tokenizer, FIRST + 100 + NEW)
    ttft: dict[bool, list[float]] = {True: [], False: []}
    reused = 0
    for rep in range(4):
        for reuse in (True, False):
            pipe.runner.prefix_reuse = False  # the first prompt always runs cold
            first = pipe.generate(text[:FIRST], max_new_tokens=32, ignore_eos=True)
            turn = np.array([*text[:FIRST], *first.tokens[:-1], *text[FIRST + 100 :]], np.int64)
            pipe.runner.prefix_reuse = reuse
            result = pipe.generate(turn, max_new_tokens=8, ignore_eos=True)
            if reuse:
                reused = pipe.kv_stats()["reused_tokens"]
            if rep:
                ttft[reuse].append(result.ttft_s)
    print(f"turn of {turn.size} tokens, {reused} of them reused from the cache")
    print(f"TTFT reused {min(ttft[True]):.3f} s, from scratch {min(ttft[False]):.3f} s")


if __name__ == "__main__":
    main()
