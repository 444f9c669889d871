"""``GET /metrics``: vLLM's metric names in Prometheus' text format, each labelled with
``model_name``, so dashboards and routers made for vLLM read npuw-kv as they read vLLM.

The request figures come from the pipeline calls themselves: :class:`CountingPipe` stands
between the worker and the pipeline, times every token its answers' streamers are given and
counts what each call returned, on the worker thread (a request whose client left is counted
too).  The KV figures are read from the pipeline when scraped: on the paged path the block
manager's running totals (prompt tokens looked up, tokens found cached) and the blocks in use,
and the scheduler's preemptions; on the NPU path the slots held and the slot scheduler's
prompt and reused tokens (nothing is preempted there); the CPU's static-shape path runs one
sequence at a time, its prefix hits counted per call (:class:`KvFigures`).

Each application has its own ``CollectorRegistry``, so several in one process do not clash.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import openvino_genai
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from ..runtime.static.slot_scheduler import SlotScheduler

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# seconds; from a cached prompt's first token on a small model to a long prompt on the NPU
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 640)
_ITL_BUCKETS = (0.005, 0.01, 0.015, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5, 10)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300, 600, 1200, 2400)
# a result's finish reason as vLLM's ``finished_reason`` label
_FINISHED = {"stop": "stop", "length": "length", "cancelled": "abort", "tool_call": "stop"}


class ServeMetrics:
    """The metrics of one served model, in a registry of their own."""

    def __init__(self, pipe: Any, model_name: str, running: Callable[[], int],
                 waiting: Callable[[], int]) -> None:  # fmt: skip
        self.registry = CollectorRegistry()
        self.model = model_name
        labels = ["model_name"]
        reg = self.registry

        def gauge(name: str, doc: str, read: Callable[[], float]) -> None:
            Gauge(name, doc, labels, registry=reg).labels(model_name).set_function(read)

        self.kv = KvFigures(pipe)
        gauge("vllm:num_requests_running", "Requests running on the pipeline now.", running)
        gauge("vllm:num_requests_waiting", "Requests admitted, waiting for a turn.", waiting)
        gauge("vllm:kv_cache_usage_perc", "Share of the KV cache in use (1 = full).",
              self.kv.usage)  # fmt: skip
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", labels,
                                     registry=reg).labels(model_name)  # fmt: skip
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", labels,
                                         registry=reg).labels(model_name)  # fmt: skip
        self.success = Counter("vllm:request_success", "Requests finished, by finish reason.",
                               [*labels, "finished_reason"], registry=reg)  # fmt: skip
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "From a request's arrival to its first token.", labels,
                              buckets=_TTFT_BUCKETS, registry=reg).labels(model_name)  # fmt: skip
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Between two tokens of one answer.", labels,
                             buckets=_ITL_BUCKETS, registry=reg).labels(model_name)  # fmt: skip
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "From a request's arrival to its last token.", labels,
                             buckets=_E2E_BUCKETS, registry=reg).labels(model_name)  # fmt: skip
        reg.register(_KvCounters(self.kv, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def call_done(self, arrival: float, stamps: Sequence[Sequence[float]], results: Sequence[Any],
                  n: int) -> None:  # fmt: skip
        """One pipeline call ended with ``results`` (``n`` answers per prompt), its answers'
        tokens given at ``stamps`` (``time.monotonic``), the request having arrived at
        ``arrival``."""
        end = time.monotonic()
        firsts = [s[0] for s in stamps if s]
        if firsts:
            self.ttft.observe(max(min(firsts) - arrival, 0.0))
        for answer in stamps:
            for before, after in zip(answer, answer[1:], strict=False):
                self.itl.observe(after - before)
        self.e2e.observe(max(end - arrival, 0.0))
        self.prompt_tokens.inc(sum(int(r.prompt_tokens) for r in results[::n]))
        self.generation_tokens.inc(sum(len(r.tokens) for r in results))
        for result in results:
            reason = _FINISHED.get(str(result.finish_reason), "stop")
            self.success.labels(self.model, reason).inc()


class KvFigures:
    """What the pipeline's KV cache says: its use now, and running totals of prompt tokens
    looked up in the prefix cache, tokens found there, and preemptions."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self.busy = 0  # pipeline calls running (the static path's cache is in use only then)
        self.static_queries = 0
        self.static_hits = 0
        self._lock = threading.Lock()
        self._seen: dict[str, int] = {}  # a source's last reading (it restarts at 0 on a reset)
        self._totals: dict[str, int] = {}

    def manager(self) -> Any:
        """The paged path's block manager; None on the static-shape path."""
        return getattr(self.pipe.runner, "blocks", None)

    def slots(self) -> SlotScheduler | None:
        """The NPU path's slots (packed generate models); None elsewhere."""
        batch = getattr(self.pipe.engine, "batch", None)
        scheduler = batch.scheduler if batch is not None else None
        return scheduler if isinstance(scheduler, SlotScheduler) else None

    def usage(self) -> float:
        slots = self.slots()
        if slots is not None:  # a slot holds a whole sequence: held slots of all
            return slots.slots_held / slots.max_num_seqs
        blocks = self.manager()
        if blocks is not None:  # cached blocks no sequence holds count as free, as in vLLM
            windows = _retry(lambda: list(blocks.stats().windows.values()))
            total = sum(w.primary_total for w in windows)
            return sum(w.primary_used for w in windows) / total if total else 0.0
        runner = self.pipe.runner
        capacity = int(runner.cache.capacity)
        if not self.busy or not capacity:
            return 0.0  # what it holds between calls is a cached prefix, free for the next
        return min(int(runner.tokens_in_cache) / capacity, 1.0)

    def after_call(self, results: Sequence[Any], n: int) -> None:
        """The static path's prefix figures of the call that just ended (on its thread): the
        runner reports its last prompt's reuse, so that prompt is what is counted."""
        if self.manager() is not None or self.slots() is not None or not results:
            return
        last = results[len(results) - n]
        with self._lock:
            self.static_queries += int(last.prompt_tokens)
            self.static_hits += int(self.pipe.runner.reused_tokens)

    def call(self, delta: int) -> None:
        with self._lock:
            self.busy += delta

    def totals(self) -> dict[str, int]:
        """Running totals that only grow: each source's growth since its last reading."""
        now = {"queries": self.static_queries, "hits": self.static_hits, "preemptions": 0}
        blocks = self.manager()
        if blocks is not None:
            now["queries"], now["hits"] = int(blocks.prompt_tokens), int(blocks.hit_tokens)
        if (slots := self.slots()) is not None:
            now["queries"], now["hits"] = slots.prompt_tokens, slots.hit_tokens
        batch = getattr(self.pipe.engine, "batch", None)
        if batch is not None:
            now["preemptions"] = int(batch.scheduler.stats.preemptions)
        with self._lock:
            for key, value in now.items():
                last = self._seen.get(key, 0)
                grown = value - last if value >= last else value  # a new manager starts at 0
                self._totals[key] = self._totals.get(key, 0) + grown
                self._seen[key] = value
            return dict(self._totals)


class _KvCounters(Collector):
    """The KV running totals as vLLM's counters, read when scraped."""

    def __init__(self, kv: KvFigures, model: str) -> None:
        self.kv, self.model = kv, model

    def describe(self) -> Iterable[Metric]:
        return []  # read only when scraped

    def collect(self) -> Iterable[Metric]:
        totals = self.kv.totals()
        for name, key, doc in (
            ("vllm:prefix_cache_queries", "queries", "Prompt tokens looked up in the cache."),
            ("vllm:prefix_cache_hits", "hits", "Prompt tokens found in the prefix cache."),
            ("vllm:num_preemptions", "preemptions", "Sequences preempted (KV room ran out)."),
        ):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model], totals[key])
            yield family


def _retry(read: Callable[[], Any]) -> Any:
    """``read()`` of state a worker thread may be changing (a dict resized mid-iteration)."""
    for _ in range(3):
        try:
            return read()
        except RuntimeError:
            continue
    return read()


class _StampingStreamer(openvino_genai.StreamerBase):
    """An answer's streamer, with the time each token was given to it, and how many it had
    been given when each piece of text left it (the inner streamer's ``sent`` texts)."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner
        self.stamps: list[float] = []
        self.counts: list[int] = []  # per text piece sent: the answer's tokens by then

    def write(self, token: Any) -> Any:
        count = len(token) if isinstance(token, (list, tuple)) else 1
        self.stamps.extend([time.monotonic()] * count)
        sent = len(getattr(self.inner, "sent", ()))
        status = self.inner.write(token)
        self.counts.extend([len(self.stamps)] * (len(getattr(self.inner, "sent", ())) - sent))
        return status

    def end(self) -> None:
        sent = len(getattr(self.inner, "sent", ()))
        self.inner.end()
        self.counts.extend([len(self.stamps)] * (len(getattr(self.inner, "sent", ())) - sent))


class CountingPipe:
    """The pipeline as the worker sees it: each ``generate`` call timed and counted into
    ``metrics``; everything else is the pipeline's.  A call's arrival time is the one
    :meth:`arrived` noted for its generation config (each request has its own)."""

    def __init__(self, pipe: Any, metrics: ServeMetrics) -> None:
        self.pipe, self.metrics = pipe, metrics
        self.arrivals: dict[int, tuple[float, int]] = {}
        self.calls: dict[int, list[_StampingStreamer]] = {}  # each request's, until forgotten

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pipe, name)

    def arrived(self, config: dict[str, Any], at: float, n: int) -> None:
        """The request whose generation config is ``config`` arrived at ``at``, for ``n``
        answers per prompt."""
        self.arrivals[id(config)] = (at, n)

    def generate(self, inputs: Any, config: Any, streamer: Any = None) -> Any:
        arrival, n = self.arrivals.pop(id(config), (time.monotonic(), 1))
        several = isinstance(streamer, list)
        given_ = streamer if several else [streamer]
        stamped = [_StampingStreamer(s) for s in given_ if s is not None]
        kv = self.metrics.kv
        kv.call(+1)
        self.calls[id(config)] = stamped
        try:
            given = stamped if several else (stamped[0] if stamped else None)
            output = self.pipe.generate(inputs, config, streamer=given)
        finally:
            kv.call(-1)
        results = getattr(output, "results", None)
        results = list(results) if results is not None else [output]
        kv.after_call(results, n)
        self.metrics.call_done(arrival, [s.stamps for s in stamped], results, n)
        return output

    def forget(self, config: dict[str, Any]) -> None:
        """The request of ``config`` is over: drop what was kept of it."""
        self.arrivals.pop(id(config), None)
        self.calls.pop(id(config), None)

    def tokens_at(self, config: dict[str, Any], answer: int, piece: int) -> int | None:
        """How many tokens answer ``answer`` of the request of ``config`` had been given when
        its text piece ``piece`` (0, 1, ...) was sent; None if not known."""
        stamped = self.calls.get(id(config))
        if stamped is None or answer >= len(stamped):
            return None
        counts = stamped[answer].counts
        return counts[piece] if piece < len(counts) else len(stamped[answer].stamps)
