#!/usr/bin/env python3
"""What the HTTP layer of ``npuw-kv serve`` costs: throughput, time to first token, memory.

Side by side in one run, on the same model and settings (the CPU default unless ``-p`` says
otherwise), greedy with ``ignore_eos`` so every answer has ``--new-tokens`` tokens:

* **throughput**: ``--clients`` chat requests sent at once by as many threads through the
  official ``openai`` client, against the same requests in one in-process
  ``LLMPipeline.generate`` call (a batch); tokens/s over the wall time, the best of
  ``--repeats``, alternating the two;
* **time to first token**: one streamed request on an idle server (to its first content chunk)
  against the in-process call's first streamed text; medians of ``--ttft-runs``;
* **memory**: the server's RSS after ``--rss-at`` requests (e.g. 100 and 1000), sent
  ``--clients`` at a time.

    python scripts/bench_serve.py                      # 16 clients, 64 tokens, RSS at 100/1000
    python scripts/bench_serve.py --quick              # a smoke run: 2 clients, 8 tokens
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai

from npuw_kv import LLMPipeline
from npuw_kv.serve.child import ServeProcess

QUESTIONS = [
    "Why is the sky blue?", "Name three fruits and their colours.", "How do plants make food?",
    "Write a short poem about the sea.", "What does a CPU do?", "Explain what rain is.",
    "Give me a tip for sleeping well.", "What is the capital of France and why is it famous?",
]  # fmt: skip


def messages(i: int) -> Any:
    return [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (request {i})"}]


def settings_of(props: list[str]) -> dict[str, str]:
    return dict(p.split("=", 1) for p in props)


def in_process(pipe: LLMPipeline, clients: int, new_tokens: int) -> float:
    """Tokens/s of the clients' requests as one batched call."""
    tokenizer = pipe.get_tokenizer()
    prompts = [
        tokenizer.apply_chat_template(messages(i), add_generation_prompt=True)
        for i in range(clients)
    ]  # the chat requests' texts: a list of chats is not one generate call
    started = time.perf_counter()
    out = pipe.generate(
        prompts, max_new_tokens=new_tokens, ignore_eos=True, apply_chat_template=False
    )
    tokens = sum(len(r.tokens) for r in out.results)
    return tokens / (time.perf_counter() - started)


def through_server(client: Any, model: str, clients: int, new_tokens: int) -> float:
    """Tokens/s of the same requests sent at once by ``clients`` threads."""

    def one(i: int) -> int:
        reply = client.chat.completions.create(
            model=model, messages=messages(i), max_tokens=new_tokens, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return reply.usage.completion_tokens

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(one, range(clients)))
    return tokens / (time.perf_counter() - started)


def first_token_in_process(pipe: LLMPipeline) -> float:
    started = time.perf_counter()
    first: list[float] = []

    def on_text(text: str) -> None:
        if not first:
            first.append(time.perf_counter() - started)

    pipe.generate(messages(0), max_new_tokens=4, ignore_eos=True, streamer=on_text)
    return first[0]


def first_token_served(client: Any, model: str) -> float:
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=messages(0), max_tokens=4, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - started
    assert first is not None
    return first


def load(client: Any, model: str, clients: int, count: int) -> None:
    """``count`` short requests, ``clients`` at a time."""

    def one(i: int) -> None:
        client.chat.completions.create(model=model, messages=messages(i), max_tokens=8)

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, range(count)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", "-m", default=None, help="as for npuw-kv (default smollm2)")
    parser.add_argument("--prop", "-p", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ttft-runs", type=int, default=5)
    parser.add_argument("--rss-at", default="100,1000", help="request counts to read RSS at")
    parser.add_argument("--quick", action="store_true", help="2 clients, 8 tokens, RSS at 4,8")
    args = parser.parse_args()
    if args.quick:
        args.clients, args.new_tokens, args.repeats, args.ttft_runs = 2, 8, 1, 1
        args.rss_at = "4,8"
    rss_at = sorted(int(n) for n in args.rss_at.split(","))
    settings = settings_of(args.prop)
    max_seqs = ["-p", f"max_num_seqs={max(args.clients, 16)}"]
    extra = [a for p in args.prop for a in ("-p", p)] + max_seqs
    model_args = ["-m", args.model] if args.model else []
    print(f"starting the server ({args.model or 'smollm2'}, {args.clients} clients) ...")
    server = ServeProcess(*model_args, *extra)
    try:
        pipe = LLMPipeline(args.model, "CPU", max_num_seqs=max(args.clients, 16), **settings)
        client = openai.OpenAI(base_url=server.url, api_key="-", max_retries=0, timeout=600)
        name = client.models.list().data[0].id
        in_process(pipe, args.clients, 4)  # warm-ups
        through_server(client, name, args.clients, 4)
        local, served = [], []
        for _ in range(args.repeats):
            local.append(in_process(pipe, args.clients, args.new_tokens))
            served.append(through_server(client, name, args.clients, args.new_tokens))
        best_local, best_served = max(local), max(served)
        print(f"throughput, {args.clients} clients x {args.new_tokens} tokens: in-process batch "
              f"{best_local:.1f} tok/s, server {best_served:.1f} tok/s: "
              f"{best_served / best_local:.2f}x")  # fmt: skip
        ttft_local = statistics.median(first_token_in_process(pipe) for _ in range(args.ttft_runs))
        ttft_served = statistics.median(
            first_token_served(client, name) for _ in range(args.ttft_runs)
        )
        print(f"time to first token, idle: in-process {ttft_local * 1000:.0f} ms, server "
              f"{ttft_served * 1000:.0f} ms: {ttft_served / ttft_local:.2f}x")  # fmt: skip
        del pipe
        done, rss = 0, {}
        for count in rss_at:
            load(client, name, args.clients, count - done)
            done = count
            server.wait_idle()
            rss[count] = server.rss_mb()
            print(f"server RSS after {count} requests: {rss[count]:.0f} MB", flush=True)
        first, last = rss[rss_at[0]], rss[rss_at[-1]]
        print(f"RSS growth from {rss_at[0]} to {rss_at[-1]} requests: {last / first:.3f}x")
    finally:
        code = server.stop()
    print(f"server stopped, exit code {code}")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
