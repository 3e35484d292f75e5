"""The GEMMs of a decode step against the bytes they read, and a prefill chunk against the
matmul rate.

- **GEMMs at the bandwidth**: each linear of a shape (qkv, o, gate/up, down, the output head)
  at decode batch sizes, as torch's ``F.linear`` runs it (cuBLAS on a GPU): time per call and
  its bytes (weight, input and output) over the device-to-device copy rate. Each call reads a
  different copy of the weight, so no weight is served from the GPU's L2 cache, and on a GPU
  the calls are timed as one CUDA graph, so launch costs do not count.
- **Prefill at the FLOP rate**: one forward of a ``--chunk``-token prefill chunk of the
  shape's random-weight model (the engine's attention and kernels, no logits) against the
  dtype's matmul rate measured on the same device (a ``--peak-size`` cubed matmul). Its FLOPs
  are the linears' (2 per weight per token) and causal attention's (QKᵀ and PV).

    python -m bench.matmul_roofline                              # GPU: llama-3.2-1b
    python -m bench.matmul_roofline --device cpu --tiny          # smoke run on the CPU

Writes ``bench/results/matmul_roofline-<device>.json``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from bench.common import write_result
from bench.decode_roofline import make_llm, model_path, release_memory
from bench.decode_timing import copy_bandwidth, device_slug, sync
from bench.model_shapes import shape_settings
from tidal.gpu.attention.paged_layout import paged_layout

L2_FLUSH_BYTES = 256 << 20  # weight copies a GEMM cycles through: past any GPU's L2 cache
MAX_COPIES = 64
CALLS = 64  # GEMM calls per timed graph (or eager loop on the CPU)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.2-1b", help="a bench.model_shapes shape")
    ap.add_argument("--batches", default=None, help="decode batches (1,16,64,128; tiny: 1,8)")
    ap.add_argument("--chunk", type=int, default=None, help="prefill tokens (2048; tiny: 64)")
    ap.add_argument("--peak-size", type=int, default=None, help="matmul side (8192; tiny 256)")
    ap.add_argument("--tiny", action="store_true", help="the shape's tiny model (CPU smoke)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--model-root", default=str(Path(tempfile.gettempdir()) / "tidal-shapes"))
    args = ap.parse_args(argv)
    tiny = args.tiny
    args.batches = [int(b) for b in (args.batches or ("1,8" if tiny else "1,16,64,128"))
                    .split(",")]
    args.chunk = args.chunk or (64 if tiny else 2048)
    args.peak_size = args.peak_size or (256 if tiny else 8192)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    return args


def seconds_per_call(fn: Callable[[int], object], device: str, calls: int = CALLS,
                     replays: int = 5) -> float:
    """Seconds one ``fn(i)`` takes, ``i`` counting calls; on a GPU timed as a captured graph
    of ``calls`` calls replayed ``replays`` times."""
    if not device.startswith("cuda"):
        fn(0)
        start = time.perf_counter()
        for i in range(calls):
            fn(i)
        return (time.perf_counter() - start) / calls
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    sync(device)
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    sync(device)
    return (time.perf_counter() - start) / (replays * calls)


def linear_shapes(settings: dict) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each linear of one layer, and of the output head."""
    hidden, inter = settings["hidden_size"], settings["intermediate_size"]
    heads, kv_heads = settings["num_attention_heads"], settings["num_key_value_heads"]
    head_dim = settings.get("head_dim") or hidden // heads
    return {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
            "o": (hidden, heads * head_dim), "gate_up": (2 * inter, hidden),
            "down": (hidden, inter), "lm_head": (settings["vocab_size"], hidden)}


def gemm_seconds(weights: list[torch.Tensor], batch: int, device: str) -> float:
    """Seconds of one ``x @ w.T`` of ``batch`` rows, each call on the next weight copy."""
    out_f, in_f = weights[0].shape
    x = torch.randn(batch, in_f, device=device, dtype=weights[0].dtype)
    out = torch.empty(batch, out_f, device=device, dtype=weights[0].dtype)
    return seconds_per_call(
        lambda i: torch.matmul(x, weights[i % len(weights)].t(), out=out), device)


@torch.inference_mode()
def gemm_rows(args: argparse.Namespace, settings: dict, bandwidth: float) -> list[dict]:
    dtype, device = getattr(torch, args.dtype), args.device
    size = torch.finfo(dtype).bits // 8
    rows = []
    for name, (out_f, in_f) in linear_shapes(settings).items():
        w_bytes = out_f * in_f * size
        copies = max(1, min(MAX_COPIES, -(-L2_FLUSH_BYTES // w_bytes)))
        weights = [torch.randn(out_f, in_f, device=device, dtype=dtype) * 0.02
                   for _ in range(copies if device.startswith("cuda") else 1)]
        for batch in args.batches:
            seconds = gemm_seconds(weights, batch, device)
            moved = w_bytes + (batch * (in_f + out_f)) * size
            rows.append({"gemm": name, "out_features": out_f, "in_features": in_f,
                         "batch": batch, "us": seconds * 1e6, "bytes": moved,
                         "bytes_per_s": moved / seconds,
                         "of_copy_rate": moved / seconds / bandwidth,
                         "tflops": 2 * batch * out_f * in_f / seconds / 1e12})
            print(f"{name:>8} {out_f:>6}x{in_f:<6} batch {batch:>4}: {seconds * 1e6:8.1f} us, "
                  f"{moved / seconds / 1e9:7.1f} GB/s ({moved / seconds / bandwidth:5.1%} of "
                  "the copy rate)")
        del weights
    return rows


@torch.inference_mode()
def matmul_rate(args: argparse.Namespace) -> float:
    """FLOP/s of a square matmul of the dtype."""
    n, dtype = args.peak_size, getattr(torch, args.dtype)
    a = torch.randn(n, n, device=args.device, dtype=dtype)
    b = torch.randn(n, n, device=args.device, dtype=dtype)
    out = torch.empty(n, n, device=args.device, dtype=dtype)
    seconds = seconds_per_call(lambda i: torch.matmul(a, b, out=out), args.device, calls=8)
    return 2 * n ** 3 / seconds


def prefill_flops(settings: dict, tokens: int) -> float:
    """The linears' and causal attention's FLOPs of one prefill chunk from position 0."""
    per_layer_weights = sum(o * i for name, (o, i) in linear_shapes(settings).items()
                            if name != "lm_head")
    heads = settings["num_attention_heads"]
    head_dim = settings.get("head_dim") or settings["hidden_size"] // heads
    attention = 2 * 2 * heads * head_dim * tokens * (tokens + 1) / 2  # QKᵀ and PV, causal
    return settings["num_hidden_layers"] * (2 * tokens * per_layer_weights + attention)


def chunk_seconds(runner: Any, tokens: int, device: str, iters: int = 5) -> float:
    """Seconds of the model's forward over one prefill chunk of ``tokens`` from position 0."""
    meta = paged_layout([0], [tokens], runner.block_size, seed=0, device=device)
    ids = torch.randint(10, runner.vocab_size, (tokens,), device=device)
    positions = torch.arange(tokens, device=device)
    for _ in range(2):
        runner.model(ids, positions, runner.kv_caches, meta)
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        runner.model(ids, positions, runner.kv_caches, meta)
    sync(device)
    return (time.perf_counter() - start) / iters


@torch.inference_mode()
def prefill(args: argparse.Namespace, rate: float) -> dict:
    settings = shape_settings(args.shape, args.tiny)
    llm_args = SimpleNamespace(device=args.device, context=args.chunk, warmup=0, steps=0,
                               enforce_eager=True, attention_backend="auto",
                               gpu_memory_utilization=0.5, tiny=args.tiny,
                               model_root=args.model_root)
    llm = make_llm(model_path(llm_args, args.shape), llm_args, max_num_seqs=1)
    seconds = chunk_seconds(llm.engine.executor.runner, args.chunk, args.device)
    flops = prefill_flops(settings, args.chunk)
    del llm
    release_memory(args.device)
    print(f"prefill of {args.chunk} tokens: {seconds * 1e3:.2f} ms, "
          f"{flops / seconds / 1e12:.1f} TFLOP/s = {flops / seconds / rate:.1%} of the matmul "
          f"rate ({rate / 1e12:.1f} TFLOP/s)")
    return {"tokens": args.chunk, "ms": seconds * 1e3, "flops": flops,
            "flops_per_s": flops / seconds, "of_matmul_rate": flops / seconds / rate}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    settings = shape_settings(args.shape, args.tiny)
    bandwidth = copy_bandwidth(args.device)
    print(f"copy bandwidth on {args.device}: {bandwidth / 1e9:.1f} GB/s")
    gemms = gemm_rows(args, settings, bandwidth)
    rate = matmul_rate(args)
    print(f"{args.dtype} matmul of {args.peak_size}^3: {rate / 1e12:.1f} TFLOP/s")
    result = {"settings": vars(args), "shape": args.shape,
              "copy_bandwidth_bytes_per_s": bandwidth, "matmul_flops_per_s": rate,
              "gemms": gemms,
              "prefill": None if args.skip_prefill else prefill(args, rate)}
    suffix = device_slug(args.device) + ("-tiny" if args.tiny else "")
    path = write_result(f"matmul_roofline-{args.shape}-{suffix}", result)
    print(f"wrote {path}")
    result["path"] = str(path)
    return result


if __name__ == "__main__":
    main()
