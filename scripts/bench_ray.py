"""``npuw-kv serve --ray`` measured: what routing does for the prefix caches, and what the
relay through Ray costs one request.

A local Ray cluster (``--nodes`` node processes on 127.0.0.1, one CPU each) serves the model.

* **routing**: ``--replicas`` replicas, once per router; ``--chats`` conversations of
  ``--turns`` turns run at once, each turn's prompt the whole conversation so far: the share
  of prompt tokens found in the replicas' prefix caches, and the busiest replica's share.
* **latency**: one streamed request at a time (``--new-tokens`` tokens, ``ignore_eos``) on
  ``npuw-kv serve`` and on one replica through Ray, alternating, ``--runs`` each: median time
  to first token and ms per token after it.

    python scripts/bench_ray.py [--replicas 2] [--chats 8] [--turns 6] [--max-tokens 64]
        [--think 1.0] [--routers prefix,power-of-two,round-robin] [--runs 5]
        [--new-tokens 64] [--skip routing|latency] [-- SERVE_ARGS...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import openai

from npuw_kv.cluster.affinity import ROUTERS
from npuw_kv.cluster.local import LocalCluster, chats, replica_totals
from npuw_kv.serve.child import ServeProcess


def run(address: str, router: str, args: argparse.Namespace) -> tuple[float, float, float, int]:
    """(hit rate, busiest replica's share of the prompt tokens, seconds, prompt tokens) of the
    workload under ``router``."""
    server = ServeProcess("--ray", address, "--replicas", str(args.replicas), "--router", router,
                          *args.serve_args)  # fmt: skip
    try:
        model = server.models()[0]
        start = time.perf_counter()
        sent = chats(server.url, model, count=args.chats, turns=args.turns,
                     max_tokens=args.max_tokens, think_s=args.think)  # fmt: skip
        seconds = time.perf_counter() - start
        time.sleep(2.5)  # the replicas leave their metrics every second
        totals = replica_totals(server.root)
    finally:
        server.stop()
    hits = sum(t["hits"] for t in totals.values())
    queries = sum(t["queries"] for t in totals.values())
    prompts = [t["prompt"] for t in totals.values()]
    return hits / max(queries, 1.0), max(prompts) / max(sum(prompts), 1.0), seconds, sent


def one_stream(client: openai.OpenAI, model: str, new_tokens: int) -> tuple[float, float]:
    """(seconds to the first content, ms per token after it) of one streamed chat."""
    start = time.perf_counter()
    first = last = 0.0
    tokens = 0
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=new_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter()
            first = first or last
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return first - start, (last - first) * 1000 / max(tokens - 1, 1)


def latency(address: str, args: argparse.Namespace) -> None:
    """Median TTFT and ms/token: npuw-kv serve against one replica through Ray."""
    servers = {"npuw-kv serve": ServeProcess(*args.serve_args),
               "--ray, 1 replica": ServeProcess("--ray", address, *args.serve_args)}  # fmt: skip
    try:
        clients = {k: openai.OpenAI(base_url=s.url, api_key="-") for k, s in servers.items()}
        model = servers["npuw-kv serve"].models()[0]
        figures: dict[str, list[tuple[float, float]]] = {k: [] for k in servers}
        for run in range(args.runs + 1):
            for name, client in clients.items():
                figure = one_stream(client, model, args.new_tokens)
                if run:  # the first round warms both up
                    figures[name].append(figure)
    finally:
        for server in servers.values():
            server.stop()
    base_ttft = statistics.median(f[0] for f in figures["npuw-kv serve"])
    base_tpot = statistics.median(f[1] for f in figures["npuw-kv serve"])
    for name, runs in figures.items():
        ttft, tpot = statistics.median(f[0] for f in runs), statistics.median(f[1] for f in runs)
        print(f"{name:>17}: TTFT {ttft * 1000:6.1f} ms ({ttft / base_ttft:.2f}x), "
              f"{tpot:5.2f} ms/token ({tpot / base_tpot:.2f}x)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--think", type=float, default=1.0, help="most seconds between turns")
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--runs", type=int, default=5, help="latency: streamed requests each")
    parser.add_argument("--new-tokens", type=int, default=64, help="latency: tokens each")
    parser.add_argument("--skip", choices=("routing", "latency"), default=None)
    parser.add_argument("serve_args", nargs="*", help="more npuw-kv serve flags, after --")
    args = parser.parse_args()
    with LocalCluster(nodes=args.nodes) as cluster:
        if args.skip != "latency":
            latency(cluster.address, args)
        if args.skip == "routing":
            return
        print(f"{args.chats} chats x {args.turns} turns, {args.replicas} replicas on "
              f"{args.nodes} nodes")  # fmt: skip
        for router in args.routers.split(","):
            rate, busiest, seconds, sent = run(cluster.address, router, args)
            print(f"{router:>13}: prefix-cache hits {rate:6.1%} of {sent} prompt tokens, "
                  f"busiest replica {busiest:6.1%} of them, {seconds:.1f} s")  # fmt: skip


if __name__ == "__main__":
    main()
