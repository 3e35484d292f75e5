"""The structured-output benchmark's summary and Markdown report: each arm's median round, the
ratios constrained / free against the targets, every round, and the compile times."""

from __future__ import annotations

import statistics
from typing import Any

from bench.common import host_line
from bench.serving_comparison import median_round
from bench.serving_report import metric

ARMS = ("free", "constrained")
# issue 34: constrained throughput at least 0.9x the free one, TTFT p50 at most 1.2x
TARGETS = {"output tok/s": (">=", 0.9), "TTFT p50 ms": ("<=", 1.2)}
# (label, path into a load-generator summary)
METRICS = (("output tok/s", ("output_token_throughput_per_s",)),
           ("TTFT p50 ms", ("ttft", "median_ms")), ("TTFT p99 ms", ("ttft", "p99_ms")),
           ("ITL p50 ms", ("itl", "median_ms")))


def ratios(free: dict[str, Any], constrained: dict[str, Any]) -> dict[str, float | None]:
    """constrained / free for every metric of ``METRICS``."""
    out: dict[str, float | None] = {}
    for label, path in METRICS:
        a, b = metric(constrained, path), metric(free, path)
        out[label] = a / b if a is not None and b else None
    return out


def totals(rounds: list[dict[str, Any]]) -> dict[str, int]:
    """The constrained arm's reply verdicts over every round."""
    out: dict[str, int] = {}
    for r in rounds:
        for key, value in r.get("validity", {}).items():
            if isinstance(value, int):
                out[key] = out.get(key, 0) + value
    return out


def summarize_arms(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    arms = {}
    for arm, reps in rounds.items():
        arms[arm] = {"median_round": median_round(reps), "rounds": reps}
        if arm == "constrained":
            arms[arm]["validity"] = totals(reps)
    return arms


def compile_summary(server: dict[str, Any], local: dict[str, Any]) -> dict[str, Any]:
    med = statistics.median
    free = med(server["free_ttft_ms"])
    return {"server_free_ttft_ms": free, "server_first_ttft_ms": server["first_ttft_ms"],
            "server_cold_ttft_ms": med(server["cold_ttft_ms"]),
            "server_cached_ttft_ms": med(server["cached_ttft_ms"]),
            "server_first_compile_ms": server["first_ttft_ms"] - free,
            "server_cold_compile_ms": med(server["cold_ttft_ms"]) - free,
            "server_cached_compile_ms": med(server["cached_ttft_ms"]) - free,
            "in_process_first_ms": local["first_ms"],
            "in_process_cold_ms": med(local["cold_ms"]),
            "in_process_cached_ms": med(local["cached_ms"])}


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def arm_table(result: dict[str, Any]) -> str:
    head = ["arm", *(label for label, _ in METRICS), "mean out tokens", "invalid replies"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, data in result["arms"].items():
        rep = data["median_round"]["classes"]["all"]
        cells = [_fmt(metric(rep, path)) for _, path in METRICS]
        mean_out = _fmt(metric(rep, ("output_tokens_per_request", "mean")))
        lines.append("| " + " | ".join([arm, *cells, mean_out, _invalid_cell(data)]) + " |")
    return "\n".join(lines)


def _invalid_cell(arm: dict[str, Any]) -> str:
    counts = arm.get("validity")
    if counts is None:
        return "-"
    checked = sum(counts.values())
    bad = checked - counts.get("valid", 0)
    return (f"{bad} of {checked} ({counts.get('cut', 0)} cut by max_tokens, "
            f"{counts.get('invalid', 0)} finished invalid, {counts.get('failed', 0)} failed)")


def ratio_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    for label, value in result["ratios"].items():
        line = f"- {label}: {_fmt(value, 2)}x"
        if label in TARGETS and value is not None:
            op, bound = TARGETS[label]
            met = value >= bound if op == ">=" else value <= bound
            line += f" (target {op} {bound}x: {'met' if met else 'missed'})"
        lines.append(line)
    return lines


def rounds_table(result: dict[str, Any]) -> str:
    """Every round's output tok/s in each arm, constrained / free round by round, and the CPU
    seconds other processes took on the host meanwhile (the server and the client left out)."""
    lines = ["| round | free tok/s | constrained tok/s | ratio | other processes' CPU s "
             "(free, constrained) |", "|---|---|---|---|---|"]
    pairs = zip(result["arms"]["free"]["rounds"], result["arms"]["constrained"]["rounds"])
    for r, (free, held) in enumerate(pairs):
        a, b = (x["classes"]["all"]["output_token_throughput_per_s"] for x in (free, held))
        other = ", ".join(_fmt(x.get("other_cpu_s"), 0) for x in (free, held))
        lines.append(f"| {r + 1} | {_fmt(a)} | {_fmt(b)} | {_fmt(b / a if a else None, 2)}x "
                     f"| {other} |")
    return "\n".join(lines)


def compile_table(c: dict[str, Any], probes: int) -> str:
    return "\n".join([
        "| measured | free | first constrained | new schema (cold) | same schema (cached) |",
        "|---|---|---|---|---|",
        f"| server TTFT ms, max_tokens 1 (median of {probes}) | "
        f"{_fmt(c['server_free_ttft_ms'])} | {_fmt(c['server_first_ttft_ms'])} | "
        f"{_fmt(c['server_cold_ttft_ms'])} | {_fmt(c['server_cached_ttft_ms'])} |",
        "| server: TTFT minus free TTFT (the compile) ms | - | "
        f"{_fmt(c['server_first_compile_ms'])} | {_fmt(c['server_cold_compile_ms'])} | "
        f"{_fmt(c['server_cached_compile_ms'])} |",
        "| in process: `GrammarCompiler.submit(...).result()` ms | - | "
        f"{_fmt(c['in_process_first_ms'])} | {_fmt(c['in_process_cold_ms'])} | "
        f"{_fmt(c['in_process_cached_ms'], 3)} |"])


def markdown(result: dict[str, Any]) -> str:
    s = result["setup"]
    parts = [
        f"# Structured outputs: constrained against free ({result.get('date', '')})", "",
        f"- host: {host_line(result.get('machine', {}))}",
        f"- model: `{s['model']}` ({s['model_params_m']}M parameters"
        f"{', shape ' + s['shape'] if s['shape'] else ''}); tidal args: "
        f"`{' '.join(s['tidal_args']) or '(defaults)'}`",
        f"- workload: streamed `/v1/completions`, concurrency {s['concurrency']}, "
        f"{s['num_requests']} requests per round, {s['input_len']}-token text prompts, "
        f"max_tokens {s['max_tokens']}, greedy; free: `ignore_eos`; constrained: "
        "`response_format` json_schema `MID_SCHEMA`",
        f"- rounds: {s['rounds']} per arm, the arms taking turns; each arm's median round by "
        f"output tok/s below; load average at start/end: {s['load_average']}", "",
        arm_table(result), "", "Ratios constrained / free:", "", *ratio_lines(result), "",
        "## Rounds", "", rounds_table(result), "",
        "## Grammar compile times", "", compile_table(result["compile"], s["compile_probes"]),
        ""]
    return "\n".join(parts)


# -- the command line -----------------------------------------------------------------------
