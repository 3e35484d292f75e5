"""Data parallel on a CPU host: two ``tidal serve`` replicas behind sglang-router, the cores
split between them, against one replica with every core, at the same concurrency.

Three layouts, each loaded with the same streamed ``/v1/completions`` (text prompts of an exact
token length, EOS ignored): one replica with every core, the same behind the router (what the
router itself costs), and ``--replicas`` replicas behind the router (``cache_aware``) with
``OMP_NUM_THREADS`` = cores / replicas each. Rounds alternate the layouts; the report keeps
every round and the medians.

    python -m bench.data_parallel                 # llama-28m, c64 x 192, 128 in / 128 out
    python -m bench.data_parallel --quick         # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, host_line, write_result
from bench.load_generator import RequestClass, Workload, run_classes
from bench.processes import LaunchedServer, SglangRouter
from bench.prompt_text import text_prompts
from tidal.app.launch import run_event_loop


@dataclass(frozen=True)
class Layout:
    name: str
    replicas: int
    threads: int  # OMP_NUM_THREADS of each replica
    router: bool


class Replica(LaunchedServer):
    def __init__(self, model: str, server_args: list[str], threads: int) -> None:
        self.threads = threads
        super().__init__(model, server_args)

    def env(self) -> dict[str, str]:
        return {**super().env(), "OMP_NUM_THREADS": str(self.threads)}


class Running:
    """A layout's processes, started together; ``url`` is where clients send requests."""

    def __init__(self, layout: Layout, model: str, server_args: list[str]) -> None:
        self.replicas = [Replica(model, [*server_args, "--served-model-name", "bench"],
                                 layout.threads) for _ in range(layout.replicas)]
        self.router: SglangRouter | None = None
        try:
            for replica in self.replicas:
                replica.wait_ready()
            if layout.router:
                self.router = SglangRouter([r.url for r in self.replicas],
                                           ["--policy", "cache_aware"])
                self.router.wait_ready()
        except BaseException:
            self.stop()
            raise
        self.url = self.router.url if self.router else self.replicas[0].url

    def stop(self) -> None:
        for proc in (self.router, *self.replicas):
            if proc is not None:
                proc.stop()


def layouts(replicas: int, cores: int) -> list[Layout]:
    return [Layout("1 replica", 1, cores, False),
            Layout("1 replica + router", 1, cores, True),
            Layout(f"{replicas} replicas + router", replicas, max(1, cores // replicas), True)]


def run_round(url: str, work: Workload, prompts: list[str]) -> dict[str, Any]:
    report = run_event_loop(run_classes(url, "bench", {"all": RequestClass(work, prompts)}))
    return report["classes"]["all"]


def medians(rounds: list[dict[str, Any]]) -> dict[str, float]:
    def med(key: str, stat: str | None = None) -> float:
        return statistics.median(r[key][stat] if stat else r[key] for r in rounds)

    return {"output_tok_s": med("output_token_throughput_per_s"),
            "best_output_tok_s": max(r["output_token_throughput_per_s"] for r in rounds),
            "req_s": med("request_throughput_per_s"),
            "ttft_p50_ms": med("ttft", "median_ms"), "ttft_p99_ms": med("ttft", "p99_ms"),
            "itl_p50_ms": med("itl", "median_ms"), "itl_p99_ms": med("itl", "p99_ms"),
            "e2e_p50_ms": med("e2e", "median_ms"), "failed": max(r["failed"] for r in rounds)}


def markdown(result: dict[str, Any]) -> str:
    work = result["workload"]
    lines = [
        f"# Data parallel: {result['replicas']} replicas behind sglang-router against one "
        f"(`{result['shape']}`)", "",
        f"Host: {host_line(result['machine'])}; load average before "
        f"{result['load_before']}, after {result['load_after']}.", "",
        f"Streamed `/v1/completions`, {work['input_len']} tokens in and {work['output_len']} "
        f"out (EOS ignored), {work['num_requests']} requests at concurrency "
        f"{work['concurrency']}; medians of {result['rounds']} rounds, layouts alternating. "
        f"Router: sglang-router {result['router_version']}, `cache_aware`.", "",
        "| layout | threads a replica | output tok/s | best round | req/s | TTFT p50 ms | "
        "TTFT p99 ms | ITL p50 ms | ITL p99 ms | E2E p50 ms | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, entry in result["layouts"].items():
        m = entry["medians"]
        lines.append(
            f"| {name} | {entry['threads']} | {m['output_tok_s']:,.0f} | "
            f"{m['best_output_tok_s']:,.0f} | {m['req_s']:.2f} | "
            f"{m['ttft_p50_ms']:,.0f} | {m['ttft_p99_ms']:,.0f} | {m['itl_p50_ms']:.1f} | "
            f"{m['itl_p99_ms']:.1f} | {m['e2e_p50_ms']:,.0f} | {m['failed']} |")
    return "\n".join(lines) + "\n"


def rerender(path: Path) -> str:
    """The Markdown of a stored result, its medians recomputed from its rounds."""
    result = json.loads(path.read_text())
    for entry in result["layouts"].values():
        entry["medians"] = medians(entry["runs"])
    path.write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    path.with_suffix(".md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    import torch
    from transformers import AutoTokenizer

    from bench.model_shapes import build_shaped_model_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-28m")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                    help="cores to split between the replicas (default: all)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=192)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra argument for every replica (repeatable)")
    ap.add_argument("--quick", action="store_true", help="c8 x 16, 32 out, one round")
    ap.add_argument("--name", default=None, help="result file name (default: "
                    "data_parallel-SHAPE)")
    ap.add_argument("--rerender", metavar="JSON", help="only rewrite the Markdown (and the "
                    "medians) of a stored result")
    args = ap.parse_args(argv)
    if args.rerender:
        print(rerender(Path(args.rerender)))
        return
    if args.quick:
        args.concurrency, args.num_requests, args.output_len, args.rounds = 8, 16, 32, 1

    from sglang_router.version import __version__ as router_version

    model = str(build_shaped_model_dir(Path(tempfile.gettempdir()) / f"tidal-bench-{args.shape}",
                                       args.shape, dtype=torch.float32))
    tokenizer = AutoTokenizer.from_pretrained(model)
    work = Workload(args.input_len, args.output_len, args.num_requests,
                    concurrency=args.concurrency)
    prompts = list(text_prompts(tokenizer, args.num_requests, args.input_len, seed=0))
    warm = Workload(16, 8, args.concurrency, concurrency=args.concurrency)
    warm_prompts = list(text_prompts(tokenizer, args.concurrency, 16, seed=7))
    load_before = os.getloadavg()
    rounds: dict[Layout, list[dict[str, Any]]] = {lay: [] for lay in layouts(args.replicas,
                                                                             args.cores)}
    for _ in range(args.rounds):
        for layout, done in rounds.items():
            running = Running(layout, model, args.server_arg)
            try:
                run_round(running.url, warm, warm_prompts)
                done.append(run_round(running.url, work, prompts))
                print(f"{layout.name}: {done[-1]['output_token_throughput_per_s']:.0f} "
                      f"output tok/s, {done[-1]['failed']} failed", flush=True)
            finally:
                running.stop()
    result = {
        "shape": args.shape, "replicas": args.replicas, "cores": args.cores,
        "workload": {"input_len": args.input_len, "output_len": args.output_len,
                     "num_requests": args.num_requests, "concurrency": args.concurrency},
        "rounds": args.rounds, "router_version": router_version,
        "server_args": args.server_arg,
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "layouts": {lay.name: {"replicas": lay.replicas, "threads": lay.threads,
                               "router": lay.router, "medians": medians(done), "runs": done}
                    for lay, done in rounds.items()},
    }
    name = args.name or f"data_parallel-{args.shape}"
    path = write_result(name, result)
    stored = json.loads(path.read_text())  # with the host's machine() entry
    (RESULTS_DIR / f"{name}.md").write_text(markdown(stored))
    print(markdown(stored))


if __name__ == "__main__":
    main()
