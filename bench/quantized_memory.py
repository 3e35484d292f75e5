"""A quantized model's memory as served: start ``python -m tidal serve`` on a random model of a
real model's shape (Qwen2.5-3B by default) with ``--quantization``, and report the time to
/health and the server process's resident memory (now and at its peak) after loading and after
some requests.

    python -m bench.quantized_memory --shape qwen2.5-3b --server-arg=--quantization \\
        --server-arg=int4

Throughput against llama.cpp on the same weights is ``bench.serving_comparison`` with
``--model`` the directory this builds and ``--peer llamacpp --llama-quant q4_0``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.common import write_result
from bench.model_shapes import ALL_SHAPES, build_shaped_model_dir
from bench.processes import LaunchedServer, memory_mb

DEFAULT_ARGS = ["--dtype", "bfloat16", "--kv-cache-memory", "256MiB", "--max-model-len", "2048"]


def complete(url: str, model: str, max_tokens: int) -> dict:
    body = json.dumps({"model": model, "prompt": "To be, or not to be, that is the question",
                       "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).encode()
    request = urllib.request.Request(url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=3600) as resp:
        out = json.loads(resp.read())
    seconds = time.perf_counter() - start
    tokens = out["usage"]["completion_tokens"]
    return {"completion_tokens": tokens, "seconds": round(seconds, 2),
            "tok_per_s": round(tokens / seconds, 2)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=list(ALL_SHAPES), default="qwen2.5-3b")
    ap.add_argument("--model", default=None, help="a model directory (default: the shape's, "
                    "built under the temporary directory)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help=f"argument for tidal's server, after {' '.join(DEFAULT_ARGS)}")
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)
    model = args.model or str(build_shaped_model_dir(
        Path(tempfile.gettempdir()) / f"tidal-bench-{args.shape}", args.shape))
    server_args = [*DEFAULT_ARGS, *args.server_arg]
    start = time.perf_counter()
    server = LaunchedServer(model, server_args)
    try:
        server.wait_ready(timeout=3600)
        ready_s = time.perf_counter() - start
        loaded = memory_mb(server.proc.pid)
        replies = [complete(server.url, model, args.max_tokens) for _ in range(args.requests)]
        served = memory_mb(server.proc.pid)
    finally:
        server.stop()
    result = {"model": model, "shape": args.shape, "server_args": server_args,
              "seconds_to_health": round(ready_s, 1), "after_load": loaded,
              "after_requests": served, "requests": replies}
    name = args.name or f"quantized_memory-{args.shape}"
    print(json.dumps(result, indent=1))
    print(f"wrote {write_result(name, result)}")


if __name__ == "__main__":
    main()
