"""Prefill attention on the CPU: the C++ kernel (every chunk of a step in one call) against
torch's fused attention on each request's gathered context (the torch backend's path), on the
same paged layouts and the bench model's heads (8 query heads, 4 KV heads of 64).

    python -m bench.prefill_attention       # writes bench/results/prefill_attention.json
    TIDAL_CPU_ISA=x86-64-v3 python -m bench.prefill_attention  # ...prefill_attention-x86-64-v3.json

Each layout is one layer's attention in one step: a 2,048-token step of fresh 64-256-token
prompts (the offline workload's prefills), single chunks, and chunks on top of cached context
(chunked prefill of long prompts).
"""

from __future__ import annotations

import argparse
import random

import torch

from bench.common import add_head_args, time_ms, write_result
from tidal.gpu.attention.cpu_backend import CpuAttentionBackend
from tidal.gpu.attention.paged_layout import paged_layout, random_caches
from tidal.gpu.attention.torch_ref import TorchAttentionBackend
from tidal.gpu.cpu.kernels import denormals_flushed, load_cpu_kernels, target_isa


def layouts(seed: int = 0) -> dict[str, tuple[list[int], list[int]]]:
    """name -> (cached context per request, query rows per request)."""
    rng = random.Random(seed)
    fresh = [rng.randint(64, 256) for _ in range(13)]
    return {
        "13 fresh prompts of 64-256": ([0] * len(fresh), fresh),
        "one fresh 192-token chunk": ([0], [192]),
        "192-token chunk after 1,800": ([1800], [192]),
        "8 chunks of 192 after 500": ([500] * 8, [192] * 8),
        "2 fresh 1,000-token prompts": ([0, 0], [1000, 1000]),
    }


def useful_gflop(context: list[int], rows: list[int], heads: int, head_dim: int) -> float:
    """Multiply-adds of q.K and p.V over the causal positions only (2 flops each)."""
    return sum(4 * heads * m * (c + (m + 1) / 2) * head_dim
               for c, m in zip(context, rows)) / 1e9


def measure(name: str, context: list[int], rows: list[int], heads: int, kv_heads: int,
            head_dim: int, repeats: int) -> dict:
    meta = paged_layout(context, rows, 16, seed=1)
    key_cache, value_cache = random_caches(meta, 16, kv_heads, head_dim)
    query = torch.randn(meta.num_actual_tokens, heads, head_dim)
    scale = head_dim ** -0.5
    kernel, peer = CpuAttentionBackend(load_cpu_kernels()), TorchAttentionBackend()
    with denormals_flushed():
        ours = time_ms(lambda: kernel.forward(query, key_cache, value_cache, meta, scale), repeats)
        theirs = time_ms(lambda: peer.forward(query, key_cache, value_cache, meta, scale), repeats)
        diff = (kernel.forward(query, key_cache, value_cache, meta, scale)
                - peer.forward(query, key_cache, value_cache, meta, scale)).abs().max().item()
    gflop = useful_gflop(context, rows, heads, head_dim)
    return {"layout": name, "cached": context, "rows": rows, "kernel_ms": ours,
            "torch_ms": theirs, "speedup": theirs / ours, "kernel_gflops": gflop / ours * 1e3,
            "torch_gflops": gflop / theirs * 1e3, "max_abs_diff": diff}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_head_args(ap, repeats=15)
    ap.add_argument("--name", help="results file name (default: prefill_attention[-isa], the "
                    "ISA where the kernels are not built for this CPU)")
    args = ap.parse_args(argv)
    if load_cpu_kernels() is None:
        raise SystemExit("the C++ CPU kernels are not available here")
    runs = [measure(name, context, rows, args.heads, args.kv_heads, args.head_dim, args.repeats)
            for name, (context, rows) in layouts().items()]
    for r in runs:
        print(f"{r['layout']:30s} kernel {r['kernel_ms']:6.2f} ms ({r['kernel_gflops']:4.0f} "
              f"GFLOP/s)  torch {r['torch_ms']:6.2f} ms ({r['torch_gflops']:4.0f})  "
              f"{r['speedup']:.2f}x")
    isa = target_isa()
    name = args.name or ("prefill_attention" if isa == "native" else f"prefill_attention-{isa}")
    result = {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
              "isa": isa, "runs": runs}
    print(f"wrote {write_result(name, result)}")
    return result


if __name__ == "__main__":
    main()
