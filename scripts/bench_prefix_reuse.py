"""TTFT of prompts whose start is in the KV cache: reused vs from scratch.

1. A chat turn: a 400-token prompt is answered (32 sampled tokens), then that prompt, its
   answer and 60 new tokens are sent.  On u8 KV (the CPU default) the paged path reuses the
   prompt's whole blocks, not the one the answer completed (written token by token).
2. Back to an earlier document: a question on document A (400 tokens), then one on document
   B, then another on A.  On the PagedAttention path (the CPU default) the block manager still
   holds A's blocks after B; the static-shape path keeps only the last prompt in its slots, so
   A runs cold unless ``--prefix-cache-tokens`` gives it a host store to copy A's blocks back
   from.

Each timed prompt runs twice in the same pipeline: with ``prefix_reuse`` (only the rest runs)
and without it (every chunk).  Best of 3 after a warm-up; both sides in one process, so compare
the ratios.

    python scripts/bench_prefix_reuse.py [--attention pa|sdpa] [--prefix-cache-tokens N]
"""

from __future__ import annotations

import argparse

import numpy as np

from npuw_kv import LLMPipeline
from npuw_kv.prompts import prompt_ids

FIRST, NEW = 400, 60


def timed(pipe: LLMPipeline, ids: np.ndarray, reuse: bool) -> tuple[float, int]:
    pipe.runner.prefix_reuse = reuse
    result = pipe.generate(ids, max_new_tokens=8, ignore_eos=True)
    return result.ttft_s, pipe.kv_stats()["reused_tokens"]


def record(
    ttft: dict[tuple[str, bool], list[float]],
    reused: dict[str, int],
    name: str,
    reuse: bool,
    rep: int,
    seconds: float,
    kept: int,
) -> None:
    if reuse:
        reused[name] = kept
    if rep:  # the first round is the warm-up
        ttft.setdefault((name, reuse), []).append(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", default="auto", choices=["auto", "pa", "sdpa"])
    parser.add_argument("--prefix-cache-tokens", type=int, default=0)
    args = parser.parse_args()
    pipe = LLMPipeline(
        None,
        "CPU",
        attention_backend=args.attention,
        prefix_cache_tokens=args.prefix_cache_tokens,
    )
    text = prompt_ids(pipe.tokenizer, 2 * FIRST + 100 + NEW)
    question = text[-NEW:]
    doc_a, doc_b = text[:FIRST], text[FIRST : 2 * FIRST]
    ttft: dict[tuple[str, bool], list[float]] = {}
    reused: dict[str, int] = {}
    for rep in range(4):
        for reuse in (True, False):
            # 1. document A answered (cold), then the chat turn on it
            pipe.runner.prefix_reuse = False
            # a sampled answer and a question never seen before: only this round's document
            # and answer can be reused, not an earlier round's turn
            seed = 2 * rep + reuse
            first = pipe.generate(
                doc_a, max_new_tokens=32, ignore_eos=True, do_sample=True, rng_seed=seed
            )
            ask = np.roll(question, seed)
            turn = np.array([*doc_a, *first.tokens[:-1], *ask], np.int64)
            record(ttft, reused, "chat turn", reuse, rep, *timed(pipe, turn, reuse))
            # 2. a question on document B (cold), then another one on A
            timed(pipe, np.concatenate([doc_b, ask]), False)
            back = np.concatenate([doc_a, ask[::-1]])
            record(ttft, reused, "A after B", reuse, rep, *timed(pipe, back, reuse))
    print(f"backend {pipe.kv_stats()['kv_binding']}")
    for name in reused:
        print(
            f"{name}: {reused[name]} tokens reused; TTFT reused "
            f"{min(ttft[name, True]):.3f} s, from scratch {min(ttft[name, False]):.3f} s"
        )


if __name__ == "__main__":
    main()
