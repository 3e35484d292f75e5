"""A first start while a co-tenant keeps every core busy, against a first start on a quiet host.

Each start has a plan cache of its own, empty (a first start on this host). The quiet start:
the server comes up, its plans are timed in the background and swapped in, then the load runs.
The busy start: a CPU-bound co-tenant (one spinning process per core) runs from before the
launch until the server's first plans are swapped in, then stops; the server serves light
requests for up to ``--serve-s`` seconds while its provisional plans are timed again once idle
(``gpu/cpu/model_upgrade.py``), then the same load runs. The target: the busy start within
10 % of the quiet start's figures.

    python -m bench.busy_start [--concurrency 1 32] [--serve-s 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import bench_model_dir, machine, write_result
from bench.load_generator import Workload, run_workload
from bench.processes import LaunchedServer, stop_process

SWAPPED = "serving on the upgraded CPU model"
RETIMED = "CPU plans timed again"
SPIN = "while True: pass"


class Server(LaunchedServer):
    """``tidal serve`` with a plan cache of its own."""

    def __init__(self, model: str, args: list[str], cache_dir: str) -> None:
        self.cache_dir = cache_dir
        super().__init__(model, args)

    def env(self) -> dict[str, str]:
        return {**super().env(), "TIDAL_CACHE_DIR": self.cache_dir}

    def logged(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def wait_for(self, text: str, limit_s: float, poke_every_s: float = 2.0) -> float | None:
        """Seconds until the log says ``text`` (None past ``limit_s``), sending a short
        request every ``poke_every_s`` (a swap happens between two steps; a re-time waits for
        the engine to idle)."""
        start = time.monotonic()
        while text not in self.logged():
            if time.monotonic() - start > limit_s:
                return None
            asyncio.run(run_workload(self.url, self.model, Workload(16, 4, 1, 1)))
            time.sleep(max(0.0, min(poke_every_s, start + limit_s - time.monotonic())))
        return time.monotonic() - start


def plans_table(log: str) -> list[str]:
    """The plan tables the server logged, the last one last."""
    tables, lines = [], log.splitlines()
    for i, line in enumerate(lines):
        if "CPU ops (" in line:
            body = [line.split("CPU ops ", 1)[1]]
            body += [row.strip() for row in lines[i + 1:] if row.startswith("  ")][:40]
            tables.append("; ".join(body))
    return tables


def measure(server: Server, concurrency: list[int], input_len: int, output_len: int
            ) -> dict[str, Any]:
    figures = {}
    for c in concurrency:
        work = Workload(input_len, output_len, max(4, 2 * c), c, seed=c)
        report = asyncio.run(run_workload(server.url, server.model, work))
        figures[f"c{c}"] = {"output_tok_s": round(report["output_token_throughput_per_s"], 1),
                            "itl_p50_ms": round(report["itl"]["median_ms"], 2)
                            if report["itl"] else None, "failed": report["failed"]}
    return figures


def run_start(model: str, busy: bool, args: argparse.Namespace) -> dict[str, Any]:
    cache = tempfile.mkdtemp(prefix="tidal-plans-")
    tenants = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in
               range(os.cpu_count() or 1)] if busy else []
    server = Server(model, ["--cpu-kernels", "auto"], cache)
    started = time.monotonic()
    try:
        server.wait_ready(300)
        swapped = server.wait_for(SWAPPED, 600)
        for tenant in tenants:
            stop_process(tenant, 10)
        retimed = server.wait_for(RETIMED, args.serve_s, poke_every_s=8.0) if busy else None
        return {"busy_first_start": busy, "plans_swapped_in_s": swapped,
                "timed_again_after_s": retimed, "served_before_load_s":
                round(time.monotonic() - started, 1),
                "load_average_before_load": list(os.getloadavg()),
                "figures": measure(server, args.concurrency, args.input_len, args.output_len),
                "plans": plans_table(server.logged())}
    finally:
        for tenant in tenants:
            stop_process(tenant, 10)
        server.stop()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--serve-s", type=float, default=60.0,
                    help="how long the busy start serves before the load, at most")
    ap.add_argument("--model", default=None, help="default: the 28M benchmark Llama")
    ap.add_argument("--name", default="busy_start")
    args = ap.parse_args(argv)
    model = args.model or str(bench_model_dir(Path(tempfile.gettempdir()) / "tidal-bench-llama"))
    before = list(os.getloadavg())
    quiet = run_start(model, False, args)
    busy = run_start(model, True, args)
    ratios = {c: round(busy["figures"][c]["output_tok_s"] / quiet["figures"][c]["output_tok_s"],
                       3) for c in quiet["figures"]}
    result = {"benchmark": "busy_start", "machine": machine(), "load_average_before": before,
              "target": "the busy first start within 10 % of the quiet one's output tok/s",
              "settings": vars(args) | {"model": model}, "quiet": quiet, "busy": busy,
              "busy_over_quiet": ratios}
    path = write_result(args.name, result)
    print(json.dumps({"busy_over_quiet": ratios, "quiet": quiet["figures"],
                      "busy": busy["figures"]}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
