#!/usr/bin/env python3
"""Benchmark of the VSWA block manager (prints figures, asserts nothing).

1. Operations per second for add_sequence / add_tokens / remove_sequence with reuse on.
2. Blocks and bytes one sequence needs for a Gemma-3-like layout (5 SWA-512 layers : 1 full)
   at 4k / 8k / 32k context, against the same model with full attention everywhere.
3. Prefix-cache hit rate on a synthetic multi-turn chat trace.

Usage: python scripts/bench_blocks.py [--quick]
"""

from __future__ import annotations

import argparse
import random
import time
import warnings

from npuw_kv.kv.blocks import BlockManagerConfig, KVBlockManager, LayerSpec

MiB = 1 << 20
GiB = 1 << 30


def gemma3_like(num_layers: int = 26, window: int | None = 512) -> list[LayerSpec]:
    """Gemma-3-1B-like: every 6th layer full attention, the others SWA; 1 KV head, dim 256."""
    return [
        LayerSpec(None if (i + 1) % 6 == 0 else window, num_kv_heads=1, head_dim=256)
        for i in range(num_layers)
    ]


def manager(
    layers: list[LayerSpec],
    max_seq_len: int,
    budget: int,
    host: int = 0,
    shares: list[float] | None = None,
) -> KVBlockManager:
    cfg = BlockManagerConfig(
        layers,
        max_seq_len=max_seq_len,
        kv_budget_bytes=budget,
        host_budget_bytes=host,
        tokens_per_block=32,
        window_size_shares=shares,
    )
    return KVBlockManager(cfg)


def add_chunked(mgr: KVBlockManager, sid: object, prompt: list[int], chunk: int) -> int:
    """How a runtime adds a long prompt: look up, then add chunk by chunk."""
    hit = mgr.lookup(prompt).hit_tokens
    first = hit + chunk
    got = mgr.add_sequence(sid, prompt[:first])
    for start in range(first, len(prompt), chunk):
        mgr.add_tokens(sid, prompt[start : start + chunk])
    return got


# ---- 1. operations per second ---------------------------------------------------------------
def bench_ops(quick: bool) -> None:
    print("== 1. operations per second (reuse on, Gemma-3-like small dims, tpb 32) ==")
    layers = [LayerSpec(None if (i + 1) % 6 == 0 else 512, 1, 8) for i in range(12)]
    mgr = manager(layers, max_seq_len=4096, budget=64 * MiB, host=32 * MiB)
    rng = random.Random(0)
    prefixes = [[rng.randrange(32000) for _ in range(rng.randrange(64, 1024))] for _ in range(8)]
    times: dict[str, list[float]] = {
        "add (65-1279 tok)*": [],
        "add_tokens (1 token)": [],
        "remove": [],
    }
    live: list[int] = []
    n_seq = 300 if quick else 2000
    decode = 32
    for sid in range(n_seq):
        prompt = rng.choice(prefixes) + [rng.randrange(32000) for _ in range(rng.randrange(1, 256))]
        t0 = time.perf_counter()
        add_chunked(mgr, sid, prompt, 512)  # max_tokens_per_call defaults to 512
        times["add (65-1279 tok)*"].append(time.perf_counter() - t0)
        live.append(sid)
        for _ in range(decode):
            t0 = time.perf_counter()
            mgr.add_tokens(sid, [rng.randrange(32000)])
            times["add_tokens (1 token)"].append(time.perf_counter() - t0)
        if len(live) > 8:
            victim = live.pop(rng.randrange(len(live)))
            t0 = time.perf_counter()
            mgr.remove_sequence(victim)
            times["remove"].append(time.perf_counter() - t0)
    for name, ts in times.items():
        total = sum(ts)
        print(
            f"  {name:20s} {len(ts):7d} calls  {len(ts) / total:10.0f} ops/s  "
            f"{1e6 * total / len(ts):8.1f} us/call"
        )
    print("  (* lookup + add_sequence + add_tokens per 512-token chunk, as a runtime does)")
    st = mgr.stats()
    print(
        f"  prompt tokens {st.prompt_tokens}, hit rate {st.hit_rate:.1%}, "
        f"offloads {st.offloads}, onboards {st.onboards}"
    )
    mgr.check_invariants()


# ---- 2. blocks and bytes per sequence --------------------------------------------------------
def bench_memory(quick: bool) -> None:
    print(
        "\n== 2. blocks and bytes per sequence: Gemma-3-like (26 layers, 1 KV head, dim 256, "
        "fp16, tpb 32; 5 SWA-512 : 1 full) =="
    )
    print(f"  {'context':>8s} {'layout':<28s} {'blocks (per window)':<30s} {'peak bytes':>12s}")
    contexts = [4096, 8192] if quick else [4096, 8192, 32768]
    for ctx in contexts:
        for name, layers, chunk in [
            ("VSWA, prefill chunks 512", gemma3_like(), 512),
            ("VSWA, decode 1 token/call", gemma3_like(), 1),
            ("all full attention", gemma3_like(window=None), 512),
        ]:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mgr = manager(layers, max_seq_len=ctx, budget=2 * ctx * 26 * 1024 * 2)
            peak: dict[int, int] = dict.fromkeys(mgr.windows, 0)
            tokens = list(range(ctx))
            mgr.add_sequence(0, tokens[:chunk])
            for start in range(chunk, ctx, chunk):
                mgr.add_tokens(0, tokens[start : start + chunk])
                for w, ws in mgr.stats().windows.items():
                    peak[w] = max(peak[w], ws.primary_used)
            groups = mgr.groups
            nbytes = sum(peak[w] * groups[w].block_bytes for w in peak)
            per = ", ".join(f"{w}: {peak[w]}" for w in sorted(peak))
            print(f"  {ctx:8d} {name:<28s} {per:<30s} {nbytes / MiB:9.1f} MiB")
    print(
        "  (VSWA 'blocks' = most blocks live at once; a 1-token decode holds window/tpb + 1 "
        "blocks per SWA window, a 512-token prefill chunk 16 more)"
    )


# ---- 3. multi-turn chat hit rate ---------------------------------------------------------------
def chat_trace(n_conv: int, turns: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, reply) per turn, round-robin over conversations; a turn's prompt is the
    conversation so far (system prompt, earlier turns and replies) plus a new user message."""
    rng = random.Random(seed)
    system = [rng.randrange(32000) for _ in range(400)]
    history = {c: list(system) for c in range(n_conv)}
    trace = []
    for _turn in range(turns):
        for c in range(n_conv):
            user = [rng.randrange(32000) for _ in range(rng.randrange(20, 150))]
            prompt = history[c] + user
            reply = [rng.randrange(32000) for _ in range(rng.randrange(40, 250))]
            trace.append((prompt, reply))
            history[c] = prompt + reply
    return trace


def run_chat(
    mgr: KVBlockManager, trace: list[tuple[list[int], list[int]]], concurrent: int
) -> float:
    """Replay: prefill in 512-token chunks, decode one token per call, keep a few requests live."""
    live: list[int] = []
    for sid, (prompt, reply) in enumerate(trace):
        add_chunked(mgr, sid, prompt, 512)
        for t in reply:
            mgr.add_tokens(sid, [t])
        live.append(sid)
        if len(live) >= concurrent:
            mgr.remove_sequence(live.pop(0))
    for sid in live:
        mgr.remove_sequence(sid)
    mgr.check_invariants()
    return mgr.stats().hit_rate


def bench_chat(quick: bool) -> None:
    n_conv, turns = (6, 4) if quick else (12, 6)
    trace = chat_trace(n_conv, turns, seed=1)
    prompt_tokens = sum(len(p) for p, _ in trace)
    print(
        f"\n== 3. multi-turn chat: {n_conv} conversations x {turns} turns, shared 400-token "
        f"system prompt, {prompt_tokens} prompt tokens, 4 live at once, Gemma-3-like =="
    )
    configs = [
        ("VSWA, 256 MiB", gemma3_like(), 256 * MiB, 0, None),
        ("VSWA, 256 MiB + 256 MiB host", gemma3_like(), 256 * MiB, 256 * MiB, None),
        ("VSWA, 256 MiB, shares 0.3,0.7", gemma3_like(), 256 * MiB, 0, [0.3, 0.7]),
        ("all full, 256 MiB", gemma3_like(window=None), 256 * MiB, 0, None),
        ("all full, 256 MiB + 256 MiB host", gemma3_like(window=None), 256 * MiB, 256 * MiB, None),
        ("VSWA, 2 GiB (~unbounded cache)", gemma3_like(), 2 * GiB, 0, None),
        ("all full, 2 GiB (~unbounded cache)", gemma3_like(window=None), 2 * GiB, 0, None),
    ]
    for name, layers, budget, host, shares in configs:
        mgr = manager(layers, max_seq_len=8192, budget=budget, host=host, shares=shares)
        t0 = time.perf_counter()
        rate = run_chat(mgr, trace, concurrent=4)
        st = mgr.stats()
        per = ", ".join(f"{w}: {ws.primary_total}" for w, ws in sorted(st.windows.items()))
        print(
            f"  {name:34s} hit rate {rate:6.1%}  offloads {st.offloads:5d} onboards "
            f"{st.onboards:5d}  primary blocks [{per}]  ({time.perf_counter() - t0:.1f} s)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs")
    args = parser.parse_args()
    bench_ops(args.quick)
    bench_memory(args.quick)
    bench_chat(args.quick)


if __name__ == "__main__":
    main()
