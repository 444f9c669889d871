"""A Ray cluster on this machine, and a chat workload to measure routing with: for the tests,
``scripts/bench_ray_routing.py`` and trying ``npuw-kv serve --ray`` without a second machine.

The cluster's nodes are separate processes (each its own raylet and object store, as on two
machines) bound to 127.0.0.1.  Ray replaces a loopback node address by the machine's network
address unless its multi-node checks are off, so this sets
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` in the environment (inherited by what it starts), which
Ray reads when it is first imported: a process that imported Ray before is refused."""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
import urllib.request
from typing import Any

from .metrics_merge import REPLICA_LABEL

TOPICS = (
    "the water cycle", "how bridges carry weight", "the history of the printing press",
    "why the sky is blue", "how vaccines train the immune system", "the rules of chess",
    "how a steam engine works", "the life of honey bees", "plate tectonics",
    "how compilers turn code into programs", "the phases of the moon", "how bread rises",
)  # fmt: skip
SYSTEM = "You are a patient teacher. Answer in short, plain sentences."


class LocalCluster:
    """``nodes`` Ray nodes of ``cpus`` CPUs each on 127.0.0.1; :meth:`stop` ends them."""

    def __init__(self, nodes: int = 2, cpus: int = 1, object_store_mb: int = 100) -> None:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        constants = sys.modules.get("ray._private.ray_constants")
        if constants is not None and getattr(constants, "ENABLE_RAY_CLUSTER", False):
            raise RuntimeError(
                "Ray was imported before LocalCluster and would put the nodes on the machine's "
                "network address: set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before importing ray"
            )
        from ray.cluster_utils import Cluster

        node: dict[str, Any] = {"num_cpus": cpus, "node_ip_address": "127.0.0.1",
                "object_store_memory": object_store_mb * 2**20}  # fmt: skip
        self.cluster = Cluster(initialize_head=True,
                               head_node_args={**node, "include_dashboard": False})  # fmt: skip
        for _ in range(nodes - 1):
            self.cluster.add_node(**node)
        self.address: str = self.cluster.address

    def stop(self) -> None:
        self.cluster.shutdown()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def post(url: str, body: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        return dict(json.load(reply))


def chats(
    url: str,
    model: str,
    *,
    count: int = 8,
    turns: int = 6,
    max_tokens: int = 64,
    think_s: float = 1.0,
    seed: int = 0,
) -> int:
    """``count`` conversations of ``turns`` turns each, all at once (one thread each): each
    turn's prompt is the whole conversation so far, sent after its user "thought" for up to
    ``think_s`` seconds (without it, a turn would follow its answer at once, to the replica
    that answer just left less busy: a closed loop that makes any load-based router look
    prefix-aware).  ``url``: the server's ``/v1``.  The prompt tokens sent, in all."""
    sent = [0] * count
    pauses = random.Random(seed)
    waits = [[pauses.uniform(0, think_s) for _ in range(turns)] for _ in range(count)]
    errors: list[BaseException] = []

    def talk(i: int) -> None:
        topic = TOPICS[i % len(TOPICS)]
        ask = f"Explain {topic} to a curious child."
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ask}]
        try:
            for turn in range(turns):
                time.sleep(waits[i][turn])
                reply = post(f"{url}/chat/completions", {"model": model, "messages": messages,
                             "max_tokens": max_tokens, "temperature": 0})  # fmt: skip
                sent[i] += int(reply["usage"]["prompt_tokens"])
                messages.append(
                    {"role": "assistant", "content": reply["choices"][0]["message"]["content"]}
                )
                messages.append(
                    {"role": "user", "content": f"Thank you. Now tell me fact {turn + 2} about it."}
                )
        except BaseException as exc:  # noqa: BLE001 - raised by the caller
            errors.append(exc)

    threads = [threading.Thread(target=talk, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return sum(sent)


def replica_totals(root: str) -> dict[str, dict[str, float]]:
    """Each replica's prompt tokens and prefix-cache hits and queries, from the ``/metrics``
    of the endpoint at ``root``: {replica: {"prompt": .., "hits": .., "queries": ..}}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{root}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    names = {"vllm:prompt_tokens_total": "prompt", "vllm:prefix_cache_hits_total": "hits",
             "vllm:prefix_cache_queries_total": "queries"}  # fmt: skip
    totals: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                replica = sample.labels[REPLICA_LABEL]
                figures = totals.setdefault(replica, dict.fromkeys(names.values(), 0.0))
                figures[names[sample.name]] += sample.value
    return totals
