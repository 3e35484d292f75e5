"""What a tidal server reports of itself over a benchmark run: two scrapes of its Prometheus
``/metrics`` text, before and after, turned into the event loop's share of the CPU, the time
from a token being sampled to its SSE event leaving the server, and where the requests' time
went: queue, prefill and decode (the engine's phase histograms)."""

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
    phases = phase_breakdown(before, after)
    if phases is not None:
        out["phases"] = phases
    if count:
        out["sampled_to_sse"] = {
            "events": count, "mean_ms": total / count * 1e3,
            "median_ms_upper_bound": _ms(_bucket_quantile(before, after, name, 0.5)),
            "p99_ms_upper_bound": _ms(_bucket_quantile(before, after, name, 0.99))}
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


# (key in the breakdown, histogram): the engine's phases of a request, end to end
PHASES = (("queue", "tidal:request_queue_time_seconds"),
          ("prefill", "tidal:request_prefill_time_seconds"),
          ("decode", "tidal:request_decode_time_seconds"))
PREPARE = (("chat_template", "tidal:request_chat_template_time_seconds"),
           ("tokenization", "tidal:request_tokenization_time_seconds"))


def _family_delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    """The run's change of a sample summed over its label sets (``model_name``)."""
    return sum(v - before.get(k, 0.0) for k, v in after.items()
               if k == name or k.startswith(name + "{"))


def phase_breakdown(before: dict[str, float], after: dict[str, float]) -> dict[str, Any] | None:
    """Where the run's finished requests spent their time in the engine: the mean seconds of
    each phase and its share of their sum, with the preemptions per request and the mean time
    the server took to template and tokenize a prompt. None when the server has no phase
    histograms (a peer, or an older tidal)."""
    if not any(k.startswith(PHASES[0][1]) for k in after):
        return None
    requests = _family_delta(before, after, PHASES[0][1] + "_count")
    if not requests:
        return None
    totals = {key: _family_delta(before, after, name + "_sum") for key, name in PHASES}
    whole = sum(totals.values()) or 1.0
    out: dict[str, Any] = {"requests": requests}
    for key, total in totals.items():
        out[key] = {"mean_ms": total / requests * 1e3, "share": total / whole}
    out["preemptions_per_request"] = _family_delta(
        before, after, "tidal:request_preemptions_sum") / requests
    for key, name in PREPARE:
        count = _family_delta(before, after, name + "_count")
        if count:
            out[key + "_mean_ms"] = _family_delta(before, after, name + "_sum") / count * 1e3
    return out


def phases_markdown(rows: list[tuple[str, dict[str, Any]]]) -> str:
    """A table of ``(workload, phase_breakdown)`` rows."""
    head = ["workload", "requests", "queue ms", "prefill ms", "decode ms",
            "queue / prefill / decode", "preemptions / req", "tokenize ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, p in rows:
        shares = " / ".join(f"{p[k]['share']:.0%}" for k, _ in PHASES)
        tokenize = p.get("tokenization_mean_ms")
        lines.append("| " + " | ".join([
            name, f"{p['requests']:.0f}", *(f"{p[k]['mean_ms']:.1f}" for k, _ in PHASES),
            shares, f"{p['preemptions_per_request']:.2f}",
            "-" if tokenize is None else f"{tokenize:.2f}"]) + " |")
    return "\n".join(lines)
