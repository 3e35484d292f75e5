"""Prometheus metrics, named after vLLM's with a ``tidal:`` prefix.

Engine gauges (running/waiting requests, KV-cache usage, prefix-cache counters) are read from
the engine's latest stats snapshot at scrape time; request-level counters and latency
histograms are recorded by the handlers through a ``RequestTracker`` per request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from core.outputs import RequestOutput

if TYPE_CHECKING:
    from core.engine_core import EngineStats

disable_created_metrics()  # no `_created` series: they double the exposition for nothing
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0)
DELIVERY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 0.5, 1.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0,
               300.0, 600.0)


class _EngineStatsCollector:
    """Exposes the engine's stats snapshot; a collector, so it is always current."""

    def __init__(self, get_stats: Callable[[], EngineStats | None]) -> None:
        self.get_stats = get_stats

    def collect(self) -> Iterator[Metric]:
        stats = self.get_stats()
        if stats is None:
            return
        yield GaugeMetricFamily("tidal:num_requests_running",
                                "Requests in the running batch.", value=stats.num_running)
        yield GaugeMetricFamily("tidal:num_requests_waiting",
                                "Requests waiting to be scheduled.", value=stats.num_waiting)
        yield GaugeMetricFamily("tidal:kv_cache_usage_perc",
                                "Fraction of KV-cache blocks in use (1 = full).",
                                value=stats.kv_cache_usage)
        yield GaugeMetricFamily("tidal:kv_cache_used_blocks", "KV-cache blocks in use.",
                                value=stats.num_total_blocks - stats.num_free_blocks)
        yield CounterMetricFamily("tidal:prefix_cache_queries",
                                  "Prompt tokens looked up in the prefix cache.",
                                  value=stats.prefix_cache_queries)
        yield CounterMetricFamily("tidal:prefix_cache_hits",
                                  "Prompt tokens found in the prefix cache.",
                                  value=stats.prefix_cache_hits)
        rate = stats.prefix_cache_hits / stats.prefix_cache_queries \
            if stats.prefix_cache_queries else 0.0
        yield GaugeMetricFamily("tidal:prefix_cache_hit_rate",
                                "Prefix-cache hits over queries since start (tokens).",
                                value=rate)
        yield CounterMetricFamily("tidal:num_preemptions",
                                  "Requests preempted for lack of KV cache.",
                                  value=stats.num_preemptions)


class _EventLoopCpuCollector:
    """CPU time of the thread that scrapes: /metrics is served on the event loop's thread,
    so this is the event loop's CPU time (compare with ``process_cpu_seconds_total``)."""

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("tidal:event_loop_cpu_seconds",
                                  "CPU time spent by the event loop's thread.",
                                  value=time.thread_time())


class ServerMetrics:
    """One registry per server, so several apps in one process do not collide."""

    def __init__(self, get_stats: Callable[[], EngineStats | None] = lambda: None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.stats_collector = _EngineStatsCollector(get_stats)
        self.registry.register(self.stats_collector)
        self.registry.register(_EventLoopCpuCollector())
        reg = self.registry
        ProcessCollector(registry=reg)
        self.prompt_tokens = Counter("tidal:prompt_tokens", "Prompt tokens processed.",
                                     registry=reg)
        self.generation_tokens = Counter("tidal:generation_tokens", "Tokens generated.",
                                         registry=reg)
        self.request_success = Counter(
            "tidal:request_success", "Finished sequences (choices) by finish reason.",
            ["finished_reason"], registry=reg)
        self.ttft = Histogram("tidal:time_to_first_token_seconds",
                              "Time from the request's arrival to its first token.",
                              buckets=TTFT_BUCKETS, registry=reg)
        self.itl = Histogram("tidal:inter_token_latency_seconds",
                             "Time between successive token deliveries of a request.",
                             buckets=ITL_BUCKETS, registry=reg)
        self.delivery = Histogram(
            "tidal:output_delivery_latency_seconds",
            "Time from the engine step that sampled a token to its streamed event being "
            "handed to the server's transport.", buckets=DELIVERY_BUCKETS, registry=reg)
        self.e2e = Histogram("tidal:e2e_request_latency_seconds",
                             "Time from the request's arrival to its end.",
                             buckets=E2E_BUCKETS, registry=reg)

    def bind_stats(self, get_stats: Callable[[], EngineStats | None]) -> None:
        self.stats_collector.get_stats = get_stats

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def track(self, num_prompt_tokens: int) -> RequestTracker:
        return RequestTracker(self, num_prompt_tokens)


@dataclass
class RequestTracker:
    """Latency and token accounting for one request, fed every delta its handler reads."""

    metrics: ServerMetrics
    num_prompt_tokens: int
    arrival: float = field(default_factory=time.monotonic)
    last_token: float | None = None
    num_generated: int = 0
    reasons: dict[int, str] = field(default_factory=dict)  # choice index -> finish reason
    done: bool = False
    step_done: float | None = None  # engine time of the delta being sent, until it is sent

    def observe(self, out: RequestOutput) -> None:
        self.step_done = out.metrics.get("step_done")
        new_tokens = sum(len(c.token_ids) for c in out.outputs)
        for c in out.outputs:
            if c.finish_reason is not None:
                self.reasons[c.index] = c.finish_reason
        if not new_tokens:
            return
        now = time.monotonic()
        if self.last_token is None:
            self.metrics.ttft.observe(now - self.arrival)
        else:
            self.metrics.itl.observe(now - self.last_token)
        self.last_token = now
        self.num_generated += new_tokens
        self.metrics.generation_tokens.inc(new_tokens)

    def sent(self) -> None:
        """A streamed event left: record how long after its tokens were sampled (once per
        delta, for its first event)."""
        if self.step_done is not None:
            self.metrics.delivery.observe(time.monotonic() - self.step_done)
            self.step_done = None

    def finish(self, num_choices: int, default_reason: str = "abort") -> None:
        """Record the end of the request; choices without a finish reason count as
        ``default_reason`` (the client left, or the engine failed)."""
        if self.done:
            return
        self.done = True
        self.metrics.prompt_tokens.inc(self.num_prompt_tokens)
        self.metrics.e2e.observe(time.monotonic() - self.arrival)
        for index in range(num_choices):
            reason = self.reasons.get(index, default_reason)
            self.metrics.request_success.labels(finished_reason=reason).inc()
