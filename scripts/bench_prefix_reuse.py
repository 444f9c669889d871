"""TTFT of prompts whose start is in the KV cache: reused vs from scratch.

1. A chat turn: a 400-token prompt is answered (32 sampled tokens), then that prompt, its
   answer and 60 new tokens are sent.  On u8 KV (the CPU default) the paged path reuses the
   prompt's whole blocks, not the one the answer completed (written token by token).
2. Back to an earlier document: a question on document A (400 tokens), then one on document
   B, then another on A.  On the PagedAttention path (the CPU default) the block manager still
   holds A's blocks after B; the static-shape path keeps only the last prompt in its slots, so
   A runs cold unless ``--prefix-cache-tokens`` gives it a host store to copy A's blocks back
   from.

Each timed prompt runs twice: in a pipeline with ``prefix_reuse`` (only the rest runs) and in
one without it (every chunk), the two taking turns.  Best of ``--rounds`` (3) after a warm-up;
both sides in one process, so compare the ratios.

    python scripts/bench_prefix_reuse.py [--attention pa|sdpa] [--prefix-cache-tokens N]
"""

from __future__ import annotations

import argparse

import numpy as np

from npuw_kv import LLMPipeline
from npuw_kv.tools.prompts import prompt_ids

FIRST, NEW = 400, 60  # document and question tokens (--doc-tokens, --question-tokens)


def timed(pipe: LLMPipeline, ids: np.ndarray) -> tuple[float, int]:
    """TTFT of ``ids`` and how many of its tokens came from the cache."""
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


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", default="auto", choices=["auto", "pa", "sdpa"])
    parser.add_argument("--prefix-cache-tokens", type=int, default=0)
    parser.add_argument("--doc-tokens", type=int, default=FIRST, help="tokens per document")
    parser.add_argument("--question-tokens", type=int, default=NEW, help="tokens per question")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after a warm-up")
    args = parser.parse_args(argv)
    if min(args.doc_tokens, args.question_tokens, args.rounds) < 1:
        parser.error("--doc-tokens, --question-tokens and --rounds must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    # the same pipeline twice: the cache of the one with prefix_reuse off is never read
    pipes = {
        reuse: LLMPipeline(
            None,
            "CPU",
            attention_backend=args.attention,
            prefix_cache_tokens=args.prefix_cache_tokens,
            prefix_reuse=reuse,
        )
        for reuse in (True, False)
    }
    first, new = args.doc_tokens, args.question_tokens
    text = prompt_ids(pipes[True].tokenizer, 2 * first + 100 + new)
    question = text[-new:]
    doc_a, doc_b = text[:first], text[first : 2 * first]
    ttft: dict[tuple[str, bool], list[float]] = {}
    reused: dict[str, int] = {}
    for rep in range(args.rounds + 1):
        for reuse, pipe in pipes.items():
            # 1. document A answered, then the chat turn on it
            # a sampled answer and a question never seen before: only this round's document
            # and answer can be reused, not an earlier round's turn
            seed = 2 * rep + reuse
            answer = pipe.generate(
                doc_a, max_new_tokens=32, ignore_eos=True, do_sample=True, rng_seed=seed
            )
            ask = np.roll(question, seed)
            turn = np.array([*doc_a, *answer.tokens[:-1], *ask], np.int64)
            record(ttft, reused, "chat turn", reuse, rep, *timed(pipe, turn))
            # 2. a question on document B, then another one on A
            timed(pipe, np.concatenate([doc_b, ask]))
            back = np.concatenate([doc_a, ask[::-1]])
            record(ttft, reused, "A after B", reuse, rep, *timed(pipe, back))
    print(f"backend {pipes[True].kv_stats()['kv_binding']}")
    for name in reused:
        print(
            f"{name}: {reused[name]} tokens reused; TTFT reused "
            f"{min(ttft[name, True]):.3f} s, from scratch {min(ttft[name, False]):.3f} s"
        )


if __name__ == "__main__":
    main()
