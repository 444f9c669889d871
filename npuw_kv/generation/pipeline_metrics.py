"""``ContinuousBatchingPipeline.get_metrics()``: genai's ``PipelineMetrics`` of the running batch.

What the last step did (the requests it ran, its duration, how full the KV pools were after
it) and, over the steps since the last ``generate`` call began, the largest and the average
cache usage (a running average over at most the last 1000 steps, as genai's).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

USAGE_WINDOW = 1000  # steps genai's average cache usage runs over


@dataclass
class PipelineMetrics:
    """genai's fields: ``requests`` not finished, ``scheduled_requests`` in the last step,
    ``cache_usage`` (percent of the KV blocks live sequences hold after the last step; the
    fullest window pool), its maximum and running average since ``generate`` began,
    ``inference_duration`` of the last step (µs) and the KV pools' bytes."""

    requests: int = 0
    scheduled_requests: int = 0
    cache_usage: float = 0.0
    max_cache_usage: float = 0.0
    avg_cache_usage: float = 0.0
    inference_duration: float = 0.0
    cache_size_in_bytes: int = 0

    @property
    def kv_cache_size_in_bytes(self) -> int:
        """genai's older name of ``cache_size_in_bytes``."""
        return self.cache_size_in_bytes


@dataclass
class MetricsRecorder:
    """Keeps :class:`PipelineMetrics` up to date step by step."""

    metrics: PipelineMetrics = field(default_factory=PipelineMetrics)
    usages: deque[float] = field(default_factory=lambda: deque(maxlen=USAGE_WINDOW))

    def reset_usage(self) -> None:
        """A ``generate`` call begins: the maximum and the average start again."""
        self.usages.clear()
        self.metrics.max_cache_usage = self.metrics.avg_cache_usage = 0.0

    def step(
        self, *, requests: int, scheduled: int, usage: float, duration_us: float, cache_bytes: int
    ) -> None:
        m = self.metrics
        m.requests, m.scheduled_requests = requests, scheduled
        m.cache_usage, m.inference_duration = usage, duration_us
        m.cache_size_in_bytes = cache_bytes
        self.usages.append(usage)
        m.max_cache_usage = max(m.max_cache_usage, usage)
        m.avg_cache_usage = sum(self.usages) / len(self.usages)

    def snapshot(self) -> PipelineMetrics:
        m = self.metrics
        return PipelineMetrics(
            m.requests, m.scheduled_requests, m.cache_usage, m.max_cache_usage,
            m.avg_cache_usage, m.inference_duration, m.cache_size_in_bytes,
        )  # fmt: skip
