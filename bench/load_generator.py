"""Client-side streaming load generator for the OpenAI API of tidal (or any compatible server).

Sends ``/v1/completions`` streams with fixed input and output lengths (prompts of random token
ids, ``ignore_eos``), either at a fixed concurrency or as a Poisson process at a given rate, and
reports time to first token, inter-token latency, time per output token and end-to-end latency
(mean / median / p99) and throughput as JSON.

When the server is tidal, it also reads ``/metrics`` before and after each run to report the
server side: the event loop's share of the process's CPU time and of the wall clock, and the
time from a token being sampled by the engine to its SSE event leaving the server.

    python -m bench.load_generator --url http://127.0.0.1:8000 --model NAME --concurrency 8
    python -m bench.load_generator --launch --concurrency 1 32   # starts a server itself
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Workload:
    input_len: int = 128
    output_len: int = 64
    num_requests: int = 64
    concurrency: int | None = None  # None with a rate: unbounded
    request_rate: float | None = None  # requests/s of a Poisson process; None: all at once
    seed: int = 0


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


def _summary(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"mean_ms": statistics.fmean(ordered) * 1e3,
            "median_ms": statistics.median(ordered) * 1e3, "p99_ms": p99 * 1e3}


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int],
                      output_len: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "stream": True,
            "ignore_eos": True, "temperature": 0.0, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last: float | None = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    result.ok = True
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = event["error"]["message"]
                    return result
                if event.get("usage") and not event["choices"]:
                    result.output_tokens = event["usage"]["completion_tokens"]
                    continue
                if not any(c.get("text") for c in event["choices"]):
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
    except httpx.HTTPError as exc:
        result.error = repr(exc)
    result.e2e = time.perf_counter() - start
    return result


async def run_workload(url: str, model: str, work: Workload) -> dict[str, Any]:
    rng = random.Random(work.seed)
    prompts = [[rng.randrange(10, 500) for _ in range(work.input_len)]
               for _ in range(work.num_requests)]
    limit = asyncio.Semaphore(work.concurrency or work.num_requests)
    limits = httpx.Limits(max_connections=(work.concurrency or work.num_requests) + 4)

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0),
                                 limits=limits) as client:
        async def limited(prompt: list[int]) -> RequestResult:
            async with limit:
                return await one_request(client, model, prompt, work.output_len)

        before = await scrape(client)
        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if work.request_rate:
                await asyncio.sleep(rng.expovariate(work.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        after = await scrape(client)

    good = [r for r in results if r.ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in good if r.output_tokens > 1]
    output_tokens = sum(r.output_tokens for r in good)
    report: dict[str, Any] = {
        "workload": asdict(work),
        "completed": len(good), "failed": len(results) - len(good),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput_per_s": len(good) / duration,
        "output_token_throughput_per_s": output_tokens / duration,
        "ttft": _summary([r.ttft for r in good]),
        "itl": _summary([x for r in good for x in r.itl]),
        "tpot": _summary(tpot),
        "e2e": _summary([r.e2e for r in good]),
    }
    if before and after:
        report["server"] = server_side(before, after, duration)
    return report


# -- the server's side, from /metrics -------------------------------------------------------
async def scrape(client: httpx.AsyncClient) -> dict[str, float] | None:
    try:
        resp = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    values = {}
    for line in resp.text.splitlines():
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


# -- launching a server ---------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def default_model() -> str:
    """The embedded model when tidal ships one, else the random ~30M-parameter Llama."""
    import core

    embedded = getattr(core, "DEFAULT_MODEL", None)
    if embedded:
        return str(embedded)
    from bench.common import bench_model_dir

    return str(bench_model_dir(Path(tempfile.gettempdir()) / "tidal-bench-llama"))


class LaunchedServer:
    def __init__(self, model: str, server_args: list[str]) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model
        cmd = [sys.executable, "-m", "app", "serve", "--model", model, "--port",
               str(self.port), *server_args]
        self.log = tempfile.NamedTemporaryFile("w+b", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {Path(self.log.name).read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError("the server did not come up")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="server to load")
    ap.add_argument("--model", help="model id to request (with --launch: the model to serve; "
                    "default: the embedded model)")
    ap.add_argument("--launch", action="store_true",
                    help="start `python -m app serve` on a free port and stop it afterwards")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra argument for the launched server (repeatable), "
                    "e.g. --server-arg=--max-num-seqs=32")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=None,
                    help="requests per run (default: 4 x concurrency, at least 8)")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[],
                    help="one run per value, at that many requests in flight")
    ap.add_argument("--request-rate", type=float, nargs="*", default=[],
                    help="one run per value: Poisson arrivals at that many requests/s")
    ap.add_argument("--warmup", type=int, default=2, help="requests sent before measuring")
    ap.add_argument("--out", help="write the JSON report here (default: bench/results/"
                    "serving.json with --launch, else stdout only)")
    args = ap.parse_args(argv)

    runs = [Workload(concurrency=c) for c in args.concurrency]
    runs += [Workload(request_rate=r) for r in args.request_rate]
    if not runs:
        runs = [Workload(concurrency=1)]
    for run in runs:
        run.input_len, run.output_len = args.input_len, args.output_len
        run.num_requests = args.num_requests or max(8, 4 * (run.concurrency or 2))

    server = None
    url, model = args.url, args.model
    if args.launch:
        model = model or default_model()
        server = LaunchedServer(model, args.server_arg)
        url = server.url
    try:
        if server is not None:
            server.wait_ready()
        if model is None:
            model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        if args.warmup:
            asyncio.run(run_workload(url, model, Workload(
                args.input_len, args.output_len, args.warmup, concurrency=args.warmup)))
        reports = [asyncio.run(run_workload(url, model, work)) for work in runs]
    finally:
        if server is not None:
            server.stop()
    result = {"url": url, "model": model, "server_args": args.server_arg, "runs": reports}
    print(json.dumps(result, indent=2))
    if args.out or args.launch:
        from bench.common import write_result

        if args.out:
            path = Path(args.out)
            path.write_text(json.dumps(result, indent=2) + "\n")
        else:
            path = write_result("serving", result)
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
