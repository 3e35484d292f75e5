"""The serving comparison's ratios (ours / peer) and its Markdown tables."""

from __future__ import annotations

from typing import Any

from bench.common import host_line
from bench.server_metrics import phases_markdown

# (label, path into a load-generator report, higher is better)
METRICS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("output tok/s", ("output_token_throughput_per_s",), True),
    ("req/s", ("request_throughput_per_s",), True),
    ("TTFT p50 ms", ("ttft", "median_ms"), False),
    ("TTFT p99 ms", ("ttft", "p99_ms"), False),
    ("ITL p50 ms", ("itl", "median_ms"), False),
    ("ITL p99 ms", ("itl", "p99_ms"), False),
    ("E2E p50 ms", ("e2e", "median_ms"), False),
    ("E2E p99 ms", ("e2e", "p99_ms"), False),
)


def metric(report: dict[str, Any] | None, path: tuple[str, ...]) -> float | None:
    value: Any = report
    for key in path:
        if not isinstance(value, dict) or value.get(key) is None:
            return None
        value = value[key]
    return float(value)


def ratios(ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, float | None]:
    """ours / peer for every metric: above 1 is better for throughputs, below 1 for
    latencies."""
    out: dict[str, float | None] = {}
    for label, path, _ in METRICS:
        a, b = metric(ours, path), metric(peer, path)
        out[label] = a / b if a is not None and b else None
    return out


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _rows(result: dict[str, Any]) -> list[tuple[str, str, dict[str, dict]]]:
    """(scenario, class, {server: class report}) for every class of every scenario."""
    rows = []
    for scenario in result["scenarios"]:
        servers = {name: rep for name, rep in scenario["reports"].items() if rep}
        classes = next(iter(servers.values()))["classes"] if servers else {}
        for cls in classes:
            rows.append((scenario["name"], cls,
                         {s: rep["classes"][cls] for s, rep in servers.items()}))
    return rows


def _label(scenario: str, cls: str) -> str:
    return scenario if cls == "all" else f"{scenario} ({cls})"


def absolute_table(result: dict[str, Any]) -> str:
    head = ["workload", "server", *(m[0] for m in METRICS), "out tok/req"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for scenario, cls, reports in _rows(result):
        for server, rep in reports.items():
            cells = [_fmt(metric(rep, path), 2 if "req/s" in label else 1)
                     for label, path, _ in METRICS]
            per_req = rep.get("output_tokens_per_request") or {}
            count = (f"{per_req['mean']:.0f}" if per_req.get("min") == per_req.get("max")
                     else f"{per_req.get('min')}-{per_req.get('max')}") if per_req else "-"
            lines.append("| " + " | ".join([_label(scenario, cls), server, *cells, count]) + " |")
    return "\n".join(lines)


def ratio_table(result: dict[str, Any], ours: str, peer: str) -> str:
    head = ["workload", *(m[0] for m in METRICS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for scenario, cls, reports in _rows(result):
        if ours not in reports or peer not in reports:
            continue
        r = ratios(reports[ours], reports[peer])
        cells = [_fmt(r[label], 2) + ("x" if r[label] is not None else "")
                 for label, _, _ in METRICS]
        lines.append("| " + " | ".join([_label(scenario, cls), *cells]) + " |")
    return "\n".join(lines)


def peers_of(result: dict[str, Any], ours: str = "tidal") -> list[str]:
    """The servers other than ``ours`` that have a report, in the order they first appear."""
    names: list[str] = []
    for scenario in result["scenarios"]:
        names += [n for n, rep in scenario["reports"].items()
                  if rep and n != ours and n not in names]
    return names


def _peer_lines(meta: dict[str, Any]) -> list[str]:
    peers = meta.get("peers")
    if peers is None:  # results written before several peers: one peer_* entry
        peers = {"peer": {"name": meta.get("peer_name"), "version": meta.get("peer_version"),
                          "args": meta.get("peer_args")}}
    lines = [f"- peer {key}: {p.get('name')} {p.get('version') or ''}, "
             f"args: `{' '.join(p.get('args') or [])}`" for key, p in peers.items()]
    lines += [f"- peer {key} skipped: {why}"
              for key, why in (meta.get("skipped_peers") or {}).items()]
    return lines


def markdown(result: dict[str, Any], ours: str = "tidal") -> str:
    """The results as Markdown: the setup and host, one ratio table ours / peer for each peer
    that ran, every server's absolute figures, and every round's output tok/s."""
    meta = result.get("setup", {})
    parts = [f"# Serving comparison ({result.get('date', '')})", "",
             f"- model: `{meta.get('model')}` ({meta.get('model_params_m', '?')}M parameters)",
             f"- host: {host_line(result.get('machine', {}))}",
             f"- load average at start/end: {meta.get('load_average')}",
             f"- tidal args: `{' '.join(meta.get('tidal_args') or []) or '(defaults)'}`",
             *_peer_lines(meta),
             "- greedy, EOS ignored; prompts are text of exact token lengths, "
             "the same for every server", ""]
    if meta.get("notes"):
        parts += [f"- note: {note}" for note in meta["notes"]] + [""]
    for peer in peers_of(result, ours):
        parts += [f"## Ratios {ours} / {peer} (throughput: higher is better; latency: lower "
                  "is better)", "", ratio_table(result, ours, peer), ""]
    parts += ["## Absolute numbers", "", absolute_table(result), ""]
    memory = memory_table(meta.get("runs") or {}, ours)
    if memory:
        parts += ["## Resident memory", "",
                  "MB of each server's process and its children (VmRSS; the peak: each "
                  "process's VmHWM, summed), once it was ready and after the last workload; "
                  "the ratio is ours / the server's at the end.", "", memory, ""]
    phases = phases_table(result, ours)
    if phases:
        parts += [f"## Where {ours}'s time went", "",
                  "Means per finished request, from the server's phase histograms over the "
                  "reported round (queue: waiting to be scheduled; prefill: to the first "
                  "token; decode: to the last).", "", phases, ""]
    rounds = rounds_table(result)
    if rounds:
        parts += ["## Rounds", "", "Each server's median round is the one reported above.",
                  "", rounds, ""]
    return "\n".join(parts)


def phases_table(result: dict[str, Any], server: str = "tidal") -> str:
    """Each workload's phase breakdown on ``server`` (tidal reads it from its /metrics)."""
    rows = [(scenario["name"], rep["server"]["phases"])
            for scenario in result["scenarios"]
            if (rep := scenario["reports"].get(server)) and (rep.get("server") or {}).get("phases")]
    return phases_markdown(rows) if rows else ""


def rounds_table(result: dict[str, Any]) -> str:
    """Every round's output tok/s per workload and server, when workloads ran repeatedly."""
    lines = []
    for scenario in result["scenarios"]:
        for server, rep in scenario["reports"].items():
            if rep and rep.get("round_output_tok_per_s"):
                tok_s = ", ".join(f"{v:.1f}" for v in rep["round_output_tok_per_s"])
                lines.append(f"| {scenario['name']} | {server} | {tok_s} |")
    if not lines:
        return ""
    return "\n".join(["| workload | server | output tok/s of each round |", "|---|---|---|",
                      *lines])


def memory_table(runs: dict[str, dict], ours: str = "tidal") -> str:
    """Each server's resident memory after loading and at the end of the run (``runs``: the
    results' ``setup.runs``), and ours over it at the end; empty for results without it."""
    def rss(run: dict, when: str, key: str = "rss_mb") -> float | None:
        return (run.get(when) or {}).get(key)

    lines = []
    for server, run in runs.items():
        end, ours_end = rss(run, "memory_at_end"), rss(runs.get(ours, {}), "memory_at_end")
        if rss(run, "memory_after_load") is None and end is None:
            continue
        ratio = f"{ours_end / end:.2f}x" if end and ours_end and server != ours else "-"
        lines.append(f"| {server} | {_fmt(rss(run, 'memory_after_load'))} | {_fmt(end)} | "
                     f"{_fmt(rss(run, 'memory_at_end', 'peak_rss_mb'))} | {ratio} |")
    if not lines:
        return ""
    return "\n".join(["| server | RSS after load | RSS at end | peak | ours / server |",
                      "|---|---|---|---|---|", *lines])
