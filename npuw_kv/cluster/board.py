"""Where the model replicas leave their ``/metrics`` for the endpoint to merge: a small actor
per model, because a replica cannot be asked directly (Ray Serve routes each call to one
replica of its choice)."""

from __future__ import annotations

import time
from typing import Any

import ray

PUSH_S = 1.0  # how often a replica leaves its metrics on the board
STALE_S = 30.0  # a replica silent this long is left out of /metrics (it died)


class _MetricsBoard:
    """The replicas' latest ``/metrics`` texts."""

    def __init__(self) -> None:
        self.texts: dict[str, tuple[str, float]] = {}

    def put(self, replica: str, text: str) -> None:
        self.texts[replica] = (text, time.time())

    def read(self, max_age_s: float) -> dict[str, str]:
        now = time.time()
        return {r: text for r, (text, at) in self.texts.items() if now - at <= max_age_s}


MetricsBoard: Any = ray.remote(num_cpus=0)(_MetricsBoard)


def board(name: str) -> Any:
    """The metrics board of one application, made by whoever asks first (it lives as long as
    that one: a replica that outlives it makes another)."""
    return MetricsBoard.options(name=name, namespace="npuw-kv", get_if_exists=True).remote()
