"""What Ray costs a step: the same tensor-parallel server with
``--distributed-executor-backend mp`` and ``ray``, under the same streamed load.

Each backend serves the same model with the same ranks and takes the same streamed
``/v1/completions`` (text prompts of an exact token length, EOS ignored, concurrency 32 by
default), after a warm-up; rounds alternate the backends. At that concurrency every stream is
in every decode step, so a stream's inter-token latency is the step's time: Ray's per-step
overhead is its median ITL less the multiprocess executor's. Both executors send the same
calls to rank 0 over a connection (a pipe, or a socket to the Ray actor), so the difference is
the transport and where Ray put the ranks.

    python -m bench.ray_overhead                  # llama-28m, TP 2, c32 x 96, 128 in / 64 out
    python -m bench.ray_overhead --quick          # a smoke run: tiny model, c32 x 32, 8 out
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, host_line, write_result
from bench.load_generator import RequestClass, Workload, run_classes
from bench.processes import LaunchedServer
from bench.prompt_text import text_prompts
from tidal.app.launch import run_event_loop

BACKENDS = ("mp", "ray")


class Server(LaunchedServer):
    process_group = True  # its worker processes (mp) go with it


def run_round(url: str, work: Workload, prompts: list[str]) -> dict[str, Any]:
    report = run_event_loop(run_classes(url, "bench", {"all": RequestClass(work, prompts)}))
    return report["classes"]["all"]


def medians(rounds: list[dict[str, Any]]) -> dict[str, float]:
    def med(key: str, stat: str | None = None) -> float:
        return statistics.median(r[key][stat] if stat else r[key] for r in rounds)

    return {"output_tok_s": med("output_token_throughput_per_s"),
            "itl_p50_ms": med("itl", "median_ms"), "itl_p99_ms": med("itl", "p99_ms"),
            "tpot_p50_ms": med("tpot", "median_ms"), "ttft_p50_ms": med("ttft", "median_ms"),
            "failed": max(r["failed"] for r in rounds)}


def markdown(result: dict[str, Any]) -> str:
    work, tp = result["workload"], result["tensor_parallel_size"]
    lines = [
        f"# Ray's per-step overhead: `{result['shape']}`, tensor parallel over {tp}", "",
        f"Host: {host_line(result['machine'])}; device {result['device']}; load average "
        f"before {result['load_before']}, after {result['load_after']}.", "",
        f"Streamed `/v1/completions`, {work['input_len']} tokens in and {work['output_len']} "
        f"out (EOS ignored), {work['num_requests']} requests at concurrency "
        f"{work['concurrency']}; medians of {result['rounds']} rounds, backends alternating.",
        "", "| backend | output tok/s | ITL p50 ms | ITL p99 ms | TPOT p50 ms | TTFT p50 ms "
        "| failed |", "|---|---|---|---|---|---|---|"]
    for name, entry in result["backends"].items():
        m = entry["medians"]
        lines.append(f"| {name} | {m['output_tok_s']:,.0f} | {m['itl_p50_ms']:.2f} | "
                     f"{m['itl_p99_ms']:.2f} | {m['tpot_p50_ms']:.2f} | {m['ttft_p50_ms']:,.0f} "
                     f"| {m['failed']} |")
    over = result["ray_overhead_ms_per_step"]
    lines += ["", f"Ray's overhead: {over:+.3f} ms a step (median ITL, ray less mp)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    import torch
    from transformers import AutoTokenizer

    from bench.model_shapes import build_shaped_model_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-28m")
    ap.add_argument("--tiny", action="store_true", help="the shape's tiny version")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=96)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra argument for both servers (repeatable)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: the tiny model, c32 x 32, 16 in / 8 out, one round")
    ap.add_argument("--name", default=None, help="result file name (default: "
                    "ray_overhead-SHAPE-tpN)")
    args = ap.parse_args(argv)
    if args.quick:
        args.tiny, args.num_requests, args.input_len, args.output_len, args.rounds = (
            True, 32, 16, 8, 1)
    model = str(build_shaped_model_dir(
        Path(tempfile.gettempdir()) / f"tidal-bench-{args.shape}{'-tiny' if args.tiny else ''}",
        args.shape, tiny=args.tiny, dtype=torch.float32))
    tokenizer = AutoTokenizer.from_pretrained(model)
    work = Workload(args.input_len, args.output_len, args.num_requests,
                    concurrency=args.concurrency)
    prompts = list(text_prompts(tokenizer, args.num_requests, args.input_len, seed=0))
    warm = Workload(16, 4, args.concurrency, concurrency=args.concurrency)
    warm_prompts = list(text_prompts(tokenizer, args.concurrency, 16, seed=7))
    server_args = ["--served-model-name", "bench", "--device", args.device,
                   "--tensor-parallel-size", str(args.tp), *args.server_arg]
    load_before = os.getloadavg()
    rounds: dict[str, list[dict[str, Any]]] = {b: [] for b in BACKENDS}
    for _ in range(args.rounds):
        for backend, done in rounds.items():
            server = Server(model, [*server_args, "--distributed-executor-backend", backend])
            try:
                server.wait_ready()
                run_round(server.url, warm, warm_prompts)
                done.append(run_round(server.url, work, prompts))
                print(f"{backend}: ITL p50 {done[-1]['itl']['median_ms']:.2f} ms, "
                      f"{done[-1]['output_token_throughput_per_s']:.0f} output tok/s, "
                      f"{done[-1]['failed']} failed", flush=True)
            finally:
                server.stop()
    backends = {b: {"medians": medians(done), "runs": done} for b, done in rounds.items()}
    result = {
        "shape": args.shape + (" (tiny)" if args.tiny else ""), "device": args.device,
        "tensor_parallel_size": args.tp,
        "workload": {"input_len": args.input_len, "output_len": args.output_len,
                     "num_requests": args.num_requests, "concurrency": args.concurrency},
        "rounds": args.rounds, "server_args": args.server_arg,
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "backends": backends,
        "ray_overhead_ms_per_step": (backends["ray"]["medians"]["itl_p50_ms"]
                                     - backends["mp"]["medians"]["itl_p50_ms"]),
    }
    name = args.name or f"ray_overhead-{args.shape}{'-tiny' if args.tiny else ''}-tp{args.tp}"
    path = write_result(name, result)
    stored = json.loads(path.read_text())  # with the host's machine() entry
    (RESULTS_DIR / f"{name}.md").write_text(markdown(stored))
    print(markdown(stored))


if __name__ == "__main__":
    main()
