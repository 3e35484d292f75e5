"""Decode attention on the CPU: the C++ kernel against the torch backend's path (scores, softmax
and weighted values over each request's gathered context), one decode row per request, on the
bench model's heads (8 query heads, 4 KV heads of 64) and shuffled paged blocks.

    python -m bench.decode_attention                      # bench/results/decode_attention.json
    python -m bench.decode_attention --dtype bfloat16     # ...decode_attention-bfloat16.json
    TIDAL_CPU_ISA=x86-64-v3 python -m bench.decode_attention  # ...decode_attention-x86-64-v3.json

Each layout is one layer's attention in one step. "In cache" layouts call the kernels on one
layer's cache over and over, so it stays in the CPU's caches (a server's batch of short
chats); "from memory" layouts go round eight layers' caches, 470 MB in float32 at 128 rows of
224 positions, more than this host's caches hold (the offline workload's decode steps).
"""

from __future__ import annotations

import argparse
import itertools

import torch

from bench.common import add_head_args, time_ms, write_result
from gpu.attention.cpu_backend import CpuAttentionBackend
from gpu.attention.paged_layout import paged_layout, random_caches
from gpu.attention.torch_ref import TorchAttentionBackend
from gpu.cpu.kernels import denormals_flushed, load_cpu_kernels, target_isa

BLOCK_SIZE = 16
# name -> (rows, positions each row attends over, layers' caches gone round)
LAYOUTS = {
    "1 row of 768, in cache": (1, 768, 1),
    "32 rows of 96, in cache": (32, 96, 1),
    "32 rows of 160, in cache": (32, 160, 1),
    "128 rows of 224, from memory": (128, 224, 8),
}


def measure(name: str, rows: int, positions: int, layers: int, heads: int, kv_heads: int,
            head_dim: int, dtype: torch.dtype, repeats: int) -> dict:
    meta = paged_layout([positions - 1] * rows, [1] * rows, BLOCK_SIZE, seed=1)
    caches = [random_caches(meta, BLOCK_SIZE, kv_heads, head_dim, dtype) for _ in range(layers)]
    query = torch.randn(rows, heads, head_dim).to(dtype)
    scale = head_dim ** -0.5
    kernel, peer = CpuAttentionBackend(load_cpu_kernels()), TorchAttentionBackend()

    def round_of(backend: CpuAttentionBackend | TorchAttentionBackend):
        turn = itertools.cycle(caches)
        return lambda: backend.forward(query, *next(turn), meta, scale)

    with denormals_flushed():
        ours = time_ms(round_of(kernel), repeats)
        theirs = time_ms(round_of(peer), repeats)
        diff = (kernel.forward(query, *caches[0], meta, scale).float()
                - peer.forward(query, *caches[0], meta, scale).float()).abs().max().item()
    cache_bytes = 2 * rows * positions * kv_heads * head_dim * dtype.itemsize
    return {"layout": name, "rows": rows, "positions": positions, "layers": layers,
            "kernel_ms": ours, "torch_ms": theirs, "speedup": theirs / ours,
            "kernel_gb_per_s": cache_bytes / ours / 1e6, "max_abs_diff": diff}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_head_args(ap, repeats=40)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    ap.add_argument("--name", help="results file name (default: decode_attention[-isa][-dtype], "
                    "the ISA where the kernels are not built for this CPU)")
    args = ap.parse_args(argv)
    if load_cpu_kernels() is None:
        raise SystemExit("the C++ CPU kernels are not available here")
    dtype = getattr(torch, args.dtype)
    runs = [measure(name, *LAYOUTS[name], args.heads, args.kv_heads, args.head_dim, dtype,
                    args.repeats) for name in args.layouts]
    for r in runs:
        print(f"{r['layout']:30s} kernel {r['kernel_ms']:6.3f} ms "
              f"({r['kernel_gb_per_s']:4.1f} GB/s)  torch {r['torch_ms']:6.3f} ms  "
              f"{r['speedup']:.2f}x")
    isa = target_isa()
    name = args.name or "-".join(filter(None, ["decode_attention",
                                               None if isa == "native" else isa,
                                               None if args.dtype == "float32" else args.dtype]))
    result = {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
              "dtype": args.dtype, "isa": isa, "runs": runs}
    print(f"wrote {write_result(name, result)}")
    return result


if __name__ == "__main__":
    main()
