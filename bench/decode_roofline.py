"""Decode step time against the memory roofline.

A decode step must read every weight once and each request's KV cache once; at batch sizes
where that dominates, the best possible step time is those bytes over the device's copy
bandwidth (measured here with a device-to-device copy). For random-weight Llamas in the shapes
of Qwen2.5-0.5B and Llama-3.2-1B (bf16), at each batch size:

- ``step_ms``: one engine step while all requests decode (scheduling, inputs, forward, sampling,
  detokenization; with the engine's defaults: CUDA graphs and overlap on);
- ``forward_ms``: the step's device work alone (graph replay, logits, argmax back to back);
- ``roofline_ms``: (weight bytes + KV bytes read) / copy bandwidth, and the ratios to it;
- ``read_roofline_ms``: the same bytes at the host's streaming read rate (a torch sum over a
  buffer far past the caches, ``bench/offline_floor.py``), and ``read_fraction``: that time
  over the step's, the share of the read rate the step reaches.

    python -m bench.decode_roofline                       # GPU: both shapes, batch 1/32/64/128
    python -m bench.decode_roofline --device cpu --tiny   # smoke run of the script on the CPU
    python -m bench.decode_roofline --quantization int4   # decoder linears in int4 (g32)

With ``--quantization`` the weight bytes are the quantized linears' as their kernel reads them
(4-bit values two to a byte, float32 scales and offsets) plus the float output head and norms,
so the roofline is the quantized step's.

Writes ``bench/results/decode_roofline-<device>.json``.
"""

from __future__ import annotations

import argparse
import gc
import os
from pathlib import Path

import torch

from bench.common import write_result
from bench.decode_timing import (
    add_decode_args,
    apply_defaults,
    copy_bandwidth,
    device_slug,
    time_decode_forward,
    time_engine_decode,
)
from bench.model_shapes import SHAPES, build_shaped_model_dir, weight_bytes
from bench.offline_floor import HostRates
from tidal.core import LLM
from tidal.core.config import QUANTIZATIONS

FULL_DEFAULTS = {"batches": "1,32,64,128", "context": 1024, "steps": 32}
TINY_DEFAULTS = {"batches": "1,4,8", "context": 64, "steps": 8}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shape names")
    ap.add_argument("--batches", help="comma-separated (default 1,32,64,128; tiny: 1,4,8)")
    ap.add_argument("--context", type=int, help="prompt tokens per request (1024; tiny: 64)")
    ap.add_argument("--steps", type=int, help="decode steps timed (32; tiny: 8)")
    ap.add_argument("--tiny", action="store_true", help="tiny models (CPU smoke run)")
    ap.add_argument("--quantization", choices=QUANTIZATIONS,
                    help="quantize the decoder linears at load")
    ap.add_argument("--quantization-group-size", type=int, default=32)
    add_decode_args(ap)
    args = ap.parse_args(argv)
    return apply_defaults(args, TINY_DEFAULTS, FULL_DEFAULTS)


def make_llm(path: Path, args: argparse.Namespace, max_num_seqs: int, **extra: object) -> LLM:
    on_gpu = args.device.startswith("cuda")
    return LLM(str(path), device=args.device, dtype="bfloat16" if on_gpu else "float32",
               max_num_seqs=max_num_seqs, max_num_batched_tokens=4096,
               max_model_len=args.context + args.warmup + args.steps + 64,
               enable_prefix_caching=False, enforce_eager=args.enforce_eager,
               attention_backend=args.attention_backend,
               gpu_memory_utilization=args.gpu_memory_utilization,
               quantization=getattr(args, "quantization", None),
               quantization_group_size=getattr(args, "quantization_group_size", 32), **extra)


def model_path(args: argparse.Namespace, shape: str) -> Path:
    name = f"{shape}-tiny" if args.tiny else shape
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    return build_shaped_model_dir(Path(args.model_root) / name, shape, args.tiny, dtype)


def release_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def run_shape(shape: str, args: argparse.Namespace, batches: list[int],
              bandwidth: float, read_rate: float) -> dict:
    llm = make_llm(model_path(args, shape), args, max(batches))
    runner = llm.engine.executor.runner
    w_bytes = weight_bytes(runner.model)
    kv_per_token = runner.model_config.kv_bytes_per_token(runner.dtype.itemsize)
    context = args.context + 1 + args.warmup + args.steps // 2  # mean over the timed steps
    rows = []
    for batch in batches:
        engine = time_engine_decode(llm, batch, args.context, args.steps, args.warmup)
        forward_ms = time_decode_forward(runner, batch, context)
        kv_bytes = batch * context * kv_per_token
        roofline_ms = 1000 * (w_bytes + kv_bytes) / bandwidth
        read_roofline_ms = 1000 * (w_bytes + kv_bytes) / read_rate
        row = {"batch": batch, "context": context, "step_ms": engine["step_ms"],
               "forward_ms": forward_ms, "roofline_ms": roofline_ms,
               "read_roofline_ms": read_roofline_ms,
               "read_fraction": read_roofline_ms / engine["step_ms"],
               "step_over_roofline": engine["step_ms"] / roofline_ms,
               "forward_over_roofline": forward_ms / roofline_ms,
               "weight_bytes": w_bytes, "kv_bytes": kv_bytes, "phases_ms": engine["phases_ms"]}
        rows.append(row)
        print(f"{shape:>14} batch {batch:>4}: step {row['step_ms']:8.3f} ms, forward "
              f"{forward_ms:8.3f} ms, roofline {roofline_ms:8.3f} ms "
              f"(step {row['step_over_roofline']:.2f}x, forward "
              f"{row['forward_over_roofline']:.2f}x; {100 * row['read_fraction']:.0f} % of "
              f"the read rate)")
    result = {"weight_bytes": w_bytes, "kv_bytes_per_token": kv_per_token,
              "cuda_graphs": runner.cuda_graphs is not None,
              "attention_backend": runner.backend.name, "dtype": str(runner.dtype),
              "rows": rows}
    del llm, runner
    release_memory(args.device)
    return result


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    bandwidth = copy_bandwidth(args.device)
    read_rate = HostRates.measure(args.device, "float32").read_bytes_per_s
    print(f"copy bandwidth on {args.device}: {bandwidth / 1e9:.1f} GB/s; streaming read "
          f"{read_rate / 1e9:.1f} GB/s")
    shapes = {shape: run_shape(shape, args, batches, bandwidth, read_rate)
              for shape in args.shapes.split(",")}
    suffix = (device_slug(args.device) + (f"-{args.quantization}" if args.quantization else "")
              + ("-tiny" if args.tiny else ""))
    path = write_result(f"decode_roofline-{suffix}", {
        "settings": vars(args), "copy_bandwidth_bytes_per_s": bandwidth,
        "read_bytes_per_s": read_rate, "load_average": list(os.getloadavg()),
        "shapes": shapes})
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
