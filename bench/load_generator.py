"""Client-side streaming load generator for the OpenAI API of tidal (or any compatible server).

Sends ``/v1/completions`` streams with fixed input and output lengths (prompts of random token
ids, ``ignore_eos``), either at a fixed concurrency or as a Poisson process at a given rate, and
reports time to first token, inter-token latency, time per output token and end-to-end latency
(mean / median / p99) and throughput as JSON.

When the server is tidal, it also reads ``/metrics`` before and after each run to report the
server side: the event loop's share of the process's CPU time and of the wall clock, and the
time from a token being sampled by the engine to its SSE event leaving the server.

Prompts may also be given as text, and requests can be shaped for ``transformers serve``
(``flavor="transformers"``: text prompts only, EOS switched off through its ``generation_config``
field), vLLM (``"vllm"``) and llama.cpp's ``llama-server`` (``"llamacpp"``);
``bench/serving_comparison.py`` uses both to load tidal and its peers alike.

    python -m bench.load_generator --url http://127.0.0.1:8000 --model NAME --concurrency 8
    python -m bench.load_generator --launch --concurrency 1 32   # starts a server itself
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp.http_exceptions import HttpProcessingError

from bench.processes import LaunchedServer
from bench.server_metrics import parse_metrics, server_side
from tidal.app.launch import run_event_loop


@dataclass
class Workload:
    input_len: int = 128
    output_len: int = 64
    num_requests: int = 64
    concurrency: int | None = None  # None with a rate: unbounded
    request_rate: float | None = None  # requests/s of a Poisson process; None: all at once
    seed: int = 0


Prompt = list[int] | str
# What one request can fail with: the connection, a line past the reader's limit, a timeout, an
# event that is not JSON. Each is that request's error, not the run's.
STREAM_ERRORS = (aiohttp.ClientError, HttpProcessingError, asyncio.TimeoutError, ValueError)
# A request whose connection failed before anything came back is sent again, up to this many
# tries in all, as the openai client retries connection errors (its default: two retries).
SEND_TRIES = 3
NOT_SENT_ERRORS = (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError)
FLAVORS = ("tidal", "transformers", "vllm", "llamacpp")


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""
    responded: bool = False  # the server answered (a status line), whatever came after


def _percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _summary(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    return {"mean_ms": statistics.fmean(ordered) * 1e3,
            "median_ms": statistics.median(ordered) * 1e3,
            "p99_ms": _percentile(ordered, 0.99) * 1e3}


def quantiles_ms(values: list[float], points: int = 101) -> list[float]:
    """``points`` evenly spaced quantiles (0 to 100 %) in milliseconds: a compact CDF."""
    if not values:
        return []
    ordered = sorted(values)
    return [round(_percentile(ordered, i / (points - 1)) * 1e3, 3) for i in range(points)]


def request_body(flavor: str, model: str, prompt: Prompt, output_len: int) -> dict[str, Any]:
    """A streamed greedy ``/v1/completions`` body producing exactly ``output_len`` tokens.

    ``transformers serve`` rejects unknown fields and token-id prompts; its EOS is switched
    off through ``generation_config`` (an ``eos_token_id`` of -1 matches no token). vLLM also
    gets ``min_tokens``; llama.cpp's ``llama-server`` takes ``ignore_eos`` as a -inf bias on
    every end-of-generation token, and ``n_predict`` (its name for ``max_tokens``). Every
    server but ``transformers serve`` reports usage at the end of the stream, so the output
    count is the server's token count, not the text chunks (a token whose text is held back,
    such as part of a UTF-8 character, or empty, such as a special token, sends none).
    """
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": output_len,
                            "stream": True, "temperature": 0.0}
    usage = {"stream_options": {"include_usage": True}}
    if flavor == "tidal":
        return body | {"ignore_eos": True} | usage
    if flavor == "vllm":
        return body | {"ignore_eos": True, "min_tokens": output_len} | usage
    if flavor == "llamacpp":
        return body | {"ignore_eos": True, "n_predict": output_len} | usage
    if flavor == "transformers":
        if not isinstance(prompt, str):
            raise ValueError("transformers serve takes text prompts only")
        config = {"max_new_tokens": output_len, "eos_token_id": -1, "do_sample": False}
        return body | {"generation_config": json.dumps(config)}
    raise ValueError(f"unknown flavor {flavor!r}; expected one of {FLAVORS}")


def _error_text(error: Any) -> str:
    return error.get("message", str(error)) if isinstance(error, dict) else str(error)


async def one_request(client: aiohttp.ClientSession, model: str, prompt: Prompt,
                      output_len: int, flavor: str = "tidal",
                      extra: dict[str, Any] | None = None) -> RequestResult:
    """Stream one completion, timing every chunk that carries text.

    A stream counts as complete at ``[DONE]``, or at its end once a choice has reported a
    ``finish_reason`` (servers that send no ``[DONE]``). Without usage in the stream, the
    output token count is the number of chunks with text. A connection that fails before any
    response is tried again (``SEND_TRIES``), its time counted in the request's.
    """
    body = request_body(flavor, model, prompt, output_len) | (extra or {})
    start = time.perf_counter()
    for attempt in range(1, SEND_TRIES + 1):
        result = RequestResult(ok=False)
        try:
            await _stream(client, body, start, result)
        except NOT_SENT_ERRORS as exc:
            result.error = repr(exc)
            if not result.responded and attempt < SEND_TRIES:
                continue
        except STREAM_ERRORS as exc:  # this request failed; the run goes on
            result.error = repr(exc)
        break
    result.e2e = time.perf_counter() - start
    return result


async def _stream(client: aiohttp.ClientSession, body: dict[str, Any], start: float,
                  result: RequestResult) -> None:
    """``one_request``'s stream into ``result``, raising what the connection raises."""
    last: float | None = None
    finished = False
    chunks = 0
    async with client.post("/v1/completions", json=body) as resp:
        result.responded = True
        if resp.status != 200:
            result.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
            return
        async for raw in resp.content:  # one line at a time
            if not raw.startswith(b"data: "):
                continue
            data = raw[6:].rstrip(b"\r\n")
            if data == b"[DONE]":
                finished = True
                break
            event = orjson.loads(data)
            if "error" in event:
                result.error = _error_text(event["error"])
                return
            if event.get("usage"):
                result.output_tokens = event["usage"].get("completion_tokens", 0)
                result.prompt_tokens = event["usage"].get("prompt_tokens", 0)
            choices = event.get("choices") or []
            finished |= any(c.get("finish_reason") for c in choices)
            if not any(c.get("text") for c in choices):
                continue
            now = time.perf_counter()
            chunks += 1
            if last is None:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            last = now
    result.ok = finished and last is not None
    if not result.ok:
        result.error = "the stream ended without a finish_reason or any text"
    result.output_tokens = result.output_tokens or chunks


def random_token_prompts(work: Workload) -> list[list[int]]:
    rng = random.Random(work.seed)
    return [[rng.randrange(10, 500) for _ in range(work.input_len)]
            for _ in range(work.num_requests)]


@dataclass
class RequestClass:
    """Requests of one kind, sent at their own concurrency or rate within a run."""

    work: Workload
    prompts: list[Prompt] | None = None  # None: random token ids of work.input_len
    extra: dict[str, Any] | None = None  # fields added to each body (``priority``, ...)


async def _send_class(client: aiohttp.ClientSession, model: str, cls: RequestClass,
                      flavor: str) -> list[RequestResult]:
    work = cls.work
    prompts = cls.prompts if cls.prompts is not None else random_token_prompts(work)
    rng = random.Random(work.seed)
    limit = asyncio.Semaphore(work.concurrency or len(prompts))

    async def limited(prompt: Prompt) -> RequestResult:
        async with limit:
            return await one_request(client, model, prompt, work.output_len, flavor,
                                     cls.extra)

    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.create_task(limited(prompt)))
        if work.request_rate:
            await asyncio.sleep(rng.expovariate(work.request_rate))
    return list(await asyncio.gather(*tasks))


async def run_classes(url: str, model: str, classes: dict[str, RequestClass],
                      flavor: str = "tidal", quantiles: bool = False) -> dict[str, Any]:
    """Run several request classes at once; one report per class plus the server side."""
    slots = sum(c.work.concurrency or len(c.prompts or ()) or c.work.num_requests
                for c in classes.values())
    async with client_session(url, slots + 4) as client:
        before = await scrape(client)
        start = time.perf_counter()
        results = await asyncio.gather(*(_send_class(client, model, c, flavor)
                                         for c in classes.values()))
        duration = time.perf_counter() - start
        after = await scrape(client)
    report: dict[str, Any] = {
        "duration_s": duration,
        "classes": {name: summarize(res, duration, cls.work, quantiles)
                    for (name, cls), res in zip(classes.items(), results)}}
    if before and after:
        report["server"] = server_side(before, after, duration)
    return report


def client_session(url: str, connections: int) -> aiohttp.ClientSession:
    """The benchmark's HTTP client, for a server root such as ``http://127.0.0.1:8000``.
    aiohttp parses responses in C: over a stream of SSE events it takes 44 us of CPU per event
    where httpx takes 108 us, CPU that on a 2-core host comes out of the server under test.
    Runs go on uvloop (``run_event_loop``): against 32 streams of a tidal server the client
    took 37 us per event there and 53 us on asyncio's own loop.
    A stream may run as long as it likes while data keeps coming (15 minutes between reads)."""
    if urllib.parse.urlsplit(url).path not in ("", "/"):
        raise ValueError(f"{url}: give the server's root URL, without a path")
    return aiohttp.ClientSession(
        base_url=url.rstrip("/"),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=900),
        connector=aiohttp.TCPConnector(limit=connections))


async def run_workload(url: str, model: str, work: Workload,
                       prompts: list[Prompt] | None = None, flavor: str = "tidal",
                       quantiles: bool = False) -> dict[str, Any]:
    mixed = await run_classes(url, model, {"all": RequestClass(work, prompts)}, flavor,
                              quantiles)
    report = mixed["classes"]["all"]
    if "server" in mixed:
        report["server"] = mixed["server"]
    return report


def summarize(results: list[RequestResult], duration: float, work: Workload,
              quantiles: bool = False) -> dict[str, Any]:
    good = [r for r in results if r.ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in good if r.output_tokens > 1]
    output_tokens = sum(r.output_tokens for r in good)
    counts = [r.output_tokens for r in good]
    report: dict[str, Any] = {
        "workload": asdict(work),
        "completed": len(good), "failed": len(results) - len(good),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput_per_s": len(good) / duration,
        "output_token_throughput_per_s": output_tokens / duration,
        "output_tokens_per_request": {"min": min(counts), "max": max(counts),
                                      "mean": statistics.fmean(counts)} if counts else None,
        "prompt_tokens_mean": statistics.fmean(r.prompt_tokens for r in good) if good else 0,
        "ttft": _summary([r.ttft for r in good]),
        "itl": _summary([x for r in good for x in r.itl]),
        "tpot": _summary(tpot),
        "e2e": _summary([r.e2e for r in good]),
    }
    if quantiles:
        report["quantiles_ms"] = {"ttft": quantiles_ms([r.ttft for r in good]),
                                  "itl": quantiles_ms([x for r in good for x in r.itl]),
                                  "e2e": quantiles_ms([r.e2e for r in good])}
    return report


# -- the server's side, from /metrics -------------------------------------------------------
async def scrape(client: aiohttp.ClientSession) -> dict[str, float] | None:
    try:
        async with client.get("/metrics") as resp:
            if resp.status != 200:
                return None
            return parse_metrics(await resp.text())
    except STREAM_ERRORS:
        return None


# -- launching a server ---------------------------------------------------------------------
def default_model() -> str:
    """The embedded model when tidal ships one, else the random ~30M-parameter Llama."""
    from tidal import core

    embedded = getattr(core, "DEFAULT_MODEL", None)
    if embedded:
        return str(embedded)
    from bench.common import bench_model_dir

    return str(bench_model_dir(Path(tempfile.gettempdir()) / "tidal-bench-llama"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000",
                    help="root URL of the server to load")
    ap.add_argument("--model", help="model id to request (with --launch: the model to serve; "
                    "default: the embedded model)")
    ap.add_argument("--launch", action="store_true",
                    help="start `python -m tidal serve` on a free port and stop it afterwards")
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
            with urllib.request.urlopen(url + "/v1/models", timeout=30) as resp:
                model = json.load(resp)["data"][0]["id"]
        if args.warmup:
            run_event_loop(run_workload(url, model, Workload(
                args.input_len, args.output_len, args.warmup, concurrency=args.warmup)))
        reports = [run_event_loop(run_workload(url, model, work)) for work in runs]
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
