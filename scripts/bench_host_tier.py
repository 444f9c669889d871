"""TTFT of a prompt whose KV was evicted to the host tier and comes back, against its cold run.

PagedAttention (the CPU default) with ``prefix_cache_host_tokens``: document A (``--doc-tokens``)
runs cold; document B, as long, needs the pool's blocks and A's go to the host tier; then A is
asked again and its whole blocks come back from host memory, so only its last block runs.
Every round takes new documents (nothing cached from an earlier round) and checks that the
restored run answers with the same tokens as the cold one.  Best of ``--rounds`` after a
warm-up round; the goal (issue 17) is a ratio <= 0.3.

    python scripts/bench_host_tier.py [--model smollm2|gemma3|DIR] [--doc-tokens 1024]
"""

from __future__ import annotations

import argparse
import sys

from npuw_kv import LLMPipeline
from npuw_kv.tools.prompts import prompt_ids

GOAL = 0.3


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, gemma3, or a model path")
    parser.add_argument("--doc-tokens", type=int, default=1024, help="tokens of each document")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens generated per prompt")
    parser.add_argument("--chunk", type=int, default=256, help="prefill_chunk_size")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after a warm-up")
    parser.add_argument("--kv-precision", default="auto", help="kv_precision (auto: u8)")
    args = parser.parse_args(argv)
    if min(args.doc_tokens, args.new_tokens, args.chunk, args.rounds) < 1:
        parser.error("--doc-tokens, --new-tokens, --chunk and --rounds must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    n = args.doc_tokens
    pipe = LLMPipeline(
        args.model,
        "CPU",
        attention_backend="pa",
        kv_precision=args.kv_precision,
        max_prompt_len=n,
        min_response_len=max(args.new_tokens, 16),
        prefill_chunk_size=args.chunk,
        prefix_cache_host_tokens=n + args.new_tokens,  # room for one document's blocks
    )
    stats = pipe.kv_stats()
    print(
        f"model {args.model}: KV pools {stats['kv_pool_blocks']} blocks "
        f"({stats['kv_bytes_allocated'] / 2**20:.1f} MiB), host tier "
        f"{stats['host_tier_blocks']} blocks ({stats['host_tier_bytes_allocated'] / 2**20:.1f} "
        f"MiB), {stats['kv_precision']} KV"
    )
    text = prompt_ids(pipe.tokenizer, 2 * n * (args.rounds + 1))
    cold_s, warm_s, identical = [], [], True
    for rnd in range(args.rounds + 1):  # round 0 warms up
        doc_a, doc_b = (
            text[2 * rnd * n : (2 * rnd + 1) * n],
            text[(2 * rnd + 1) * n : (2 * rnd + 2) * n],
        )
        cold = pipe.generate(doc_a, max_new_tokens=args.new_tokens, ignore_eos=True)
        before = pipe.kv_stats()
        pipe.generate(doc_b, max_new_tokens=args.new_tokens, ignore_eos=True)
        evicted = pipe.kv_stats()
        warm = pipe.generate(doc_a, max_new_tokens=args.new_tokens, ignore_eos=True)
        after = pipe.kv_stats()
        offloaded = evicted["host_tier_bytes_offloaded"] - before["host_tier_bytes_offloaded"]
        restored = after["host_tier_bytes_restored"] - evicted["host_tier_bytes_restored"]
        same = list(warm.tokens) == list(cold.tokens)
        identical &= same
        print(
            f"round {rnd}{' (warm-up)' if not rnd else ''}: cold TTFT {cold.ttft_s * 1e3:.1f} ms, "
            f"restored {warm.ttft_s * 1e3:.1f} ms; {after['reused_tokens']} of {n} tokens "
            f"reused, {offloaded / 2**20:.2f} MiB offloaded by B, {restored / 2**20:.2f} MiB "
            f"restored; tokens identical: {same}"
        )
        if rnd:
            cold_s.append(cold.ttft_s)
            warm_s.append(warm.ttft_s)
    ratio = min(warm_s) / min(cold_s)
    print(
        f"best TTFT: cold {min(cold_s) * 1e3:.1f} ms, restored from the host tier "
        f"{min(warm_s) * 1e3:.1f} ms; ratio {ratio:.3f} (goal <= {GOAL}); "
        f"tokens identical: {identical}"
    )
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
