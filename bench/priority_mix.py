"""Priorities under load: a mixed stream where a tenth of the requests carry priority 0 and
the rest priority 1, against a server started with ``--scheduling-policy priority``, and the
same stream against one scheduling first come, first served (the requests' priorities left
out). The issue's target: the urgent requests' TTFT p99 at most 0.3x the others' under
``priority``.

The load: Poisson arrivals of streamed completions on the benchmark Llama in float32, at a
rate above what the batch (``--max-num-seqs``) serves, so a queue builds and the order of
admission decides who waits.

    python -m bench.priority_mix [--rate 12] [--num-requests 200] [--max-num-seqs 16]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

from bench.common import bench_model_dir, machine, write_result
from bench.load_generator import RequestClass, Workload, run_classes
from bench.processes import LaunchedServer
from tidal.app.launch import run_event_loop


def _classes(args: argparse.Namespace, with_priority: bool) -> dict[str, RequestClass]:
    urgent = max(1, args.num_requests // 10)
    normal = args.num_requests - urgent
    work = {"input_len": args.input_len, "output_len": args.output_len}

    def extra(priority: int) -> dict[str, Any] | None:
        return {"priority": priority} if with_priority else None

    return {"urgent": RequestClass(Workload(**work, num_requests=urgent,
                                            request_rate=args.rate / 10, seed=1), extra=extra(0)),
            "normal": RequestClass(Workload(**work, num_requests=normal,
                                            request_rate=args.rate * 9 / 10, seed=2),
                                   extra=extra(1))}


def _run(model: str, args: argparse.Namespace, policy: str) -> dict[str, Any]:
    server = LaunchedServer(model, ["--scheduling-policy", policy, "--max-num-seqs",
                                    str(args.max_num_seqs)])
    try:
        server.wait_ready()
        warm = {"warm": RequestClass(Workload(args.input_len, 8, args.max_num_seqs))}
        run_event_loop(run_classes(server.url, model, warm))
        return run_event_loop(run_classes(server.url, model,
                                          _classes(args, policy == "priority")))
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=12.0, help="requests/s, both classes")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--model", default=None, help="HF model directory (default: the random "
                    "~30M benchmark Llama)")
    ap.add_argument("--name", default="priority_mix", help="the result file's name")
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(bench_model_dir(tmp))
        runs = {policy: _run(model, args, policy) for policy in ("priority", "fcfs")}
    result: dict[str, Any] = {"machine": machine(), "load_average_before": load,
                              "settings": vars(args), "runs": runs}
    ratio = None
    classes = runs["priority"]["classes"]
    if classes["urgent"]["ttft"] and classes["normal"]["ttft"]:
        ratio = classes["urgent"]["ttft"]["p99_ms"] / classes["normal"]["ttft"]["p99_ms"]
    result["urgent_over_normal_ttft_p99"] = ratio
    for policy, run in runs.items():
        for name, report in run["classes"].items():
            ttft = report["ttft"] or {}
            print(f"{policy:9s} {name:7s} completed {report['completed']:4d}  TTFT p50 "
                  f"{ttft.get('median_ms', 0):8.1f} ms  p99 {ttft.get('p99_ms', 0):8.1f} ms")
    print(f"urgent / normal TTFT p99 under priority: {ratio:.3f}" if ratio else "no ratio")
    print(write_result(args.name, result))


if __name__ == "__main__":
    main()
