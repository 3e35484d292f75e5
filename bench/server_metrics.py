"""What a tidal server reports of itself over a benchmark run: two scrapes of its Prometheus
``/metrics`` text, before and after, turned into the event loop's share of the CPU and the time
from a token being sampled to its SSE event leaving the server."""

from __future__ import annotations

from typing import Any


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition as ``{name with labels: value}``."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float | None:
    if name not in after:
        return None
    return after[name] - before.get(name, 0.0)


def _bucket_quantile(before: dict[str, float], after: dict[str, float], name: str,
                     q: float) -> float | None:
    """The upper bound of the histogram bucket holding quantile ``q`` of this run."""
    prefix = name + '_bucket{le="'
    buckets = sorted((float(k[len(prefix):-2]), v - before.get(k, 0.0))
                     for k, v in after.items() if k.startswith(prefix))
    total = buckets[-1][1] if buckets else 0
    if not total:
        return None
    for bound, count in buckets:
        if count >= q * total:
            return bound
    return None


def server_side(before: dict[str, float], after: dict[str, float], wall: float
                ) -> dict[str, Any]:
    loop_cpu = _delta(before, after, "tidal:event_loop_cpu_seconds_total")
    process_cpu = _delta(before, after, "process_cpu_seconds_total")
    name = "tidal:output_delivery_latency_seconds"
    count = _delta(before, after, name + "_count") or 0
    total = _delta(before, after, name + "_sum") or 0.0
    out: dict[str, Any] = {"event_loop_cpu_s": loop_cpu, "process_cpu_s": process_cpu}
    if loop_cpu is not None:
        out["event_loop_share_of_wall"] = loop_cpu / wall
        if process_cpu:
            out["event_loop_share_of_process_cpu"] = loop_cpu / process_cpu
    if count:
        out["sampled_to_sse"] = {
            "events": count, "mean_ms": total / count * 1e3,
            "median_ms_upper_bound": _ms(_bucket_quantile(before, after, name, 0.5)),
            "p99_ms_upper_bound": _ms(_bucket_quantile(before, after, name, 0.99))}
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3
