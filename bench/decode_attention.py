"""Decode attention on the CPU: the C++ kernel against the torch backend's path (scores, softmax
and weighted values over each request's gathered context), one decode row per request, on the
bench model's heads (8 query heads, 4 KV heads of 64) and shuffled paged blocks.

    python -m bench.decode_attention                      # bench/results/decode_attention.json
    python -m bench.decode_attention --dtype bfloat16     # ...decode_attention-bfloat16.json
    TIDAL_CPU_ISA=x86-64-v3 python -m bench.decode_attention  # ...decode_attention-x86-64-v3.json
    python -m bench.decode_attention --kv-cache-dtype int8 --layouts long
                                                          # ...decode_attention-int8.json

Each layout is one layer's attention in one step. "In cache" layouts call the kernels on one
layer's cache over and over, so it stays in the CPU's caches (a server's batch of short
chats); "from memory" layouts go round eight layers' caches, 470 MB in float32 at 128 rows of
224 positions, more than this host's caches hold (the offline workload's decode steps).

``--kv-cache-dtype int8`` times the kernel over an int8 cache (``gpu/attention/kv_quant.py``,
the same random keys and values quantized) beside the float kernel and the torch path over it;
``--layouts long`` names the long contexts, where each step's read of the cache dominates.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from bench.common import add_head_args, best_ms, time_ms, write_result
from tidal.core.config import KV_CACHE_DTYPES
from tidal.gpu.attention.cpu_backend import CpuAttentionBackend
from tidal.gpu.attention.kv_quant import quantize_caches
from tidal.gpu.attention.metadata import AttentionMetadata
from tidal.gpu.attention.paged_layout import paged_layout, random_caches
from tidal.gpu.attention.torch_ref import TorchAttentionBackend
from tidal.gpu.cpu.kernels import denormals_flushed, load_cpu_kernels, target_isa

BLOCK_SIZE = 16
# name -> (rows, positions each row attends over, layers' caches gone round)
LAYOUTS = {
    "1 row of 768, in cache": (1, 768, 1),
    "32 rows of 96, in cache": (32, 96, 1),
    "32 rows of 160, in cache": (32, 160, 1),
    "128 rows of 224, from memory": (128, 224, 8),
}
# Long contexts, going round enough layers that even the int8 caches (a quarter of float32's
# bytes, plus the scales) are twice this host's 260 MB L3: about 2.1 GB of float32 caches each.
LONG_LAYOUTS = {
    "4 rows of 4096, from memory": (4, 4096, 64),
    "32 rows of 1024, from memory": (32, 1024, 32),
}


def measure(name: str, rows: int, positions: int, layers: int, heads: int, kv_heads: int,
            head_dim: int, dtype: torch.dtype, repeats: int, int8: bool = False) -> dict:
    meta = paged_layout([positions - 1] * rows, [1] * rows, BLOCK_SIZE, seed=1)
    caches = [random_caches(meta, BLOCK_SIZE, kv_heads, head_dim, dtype) for _ in range(layers)]
    query = torch.randn(rows, heads, head_dim).to(dtype)
    if int8:
        return _measure_int8(name, meta, caches, query, repeats)
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


def _measure_int8(name: str, meta: AttentionMetadata, caches: list, query: torch.Tensor,
                  repeats: int) -> dict:
    """The kernel over the int8 copies of ``caches`` against itself over the float ones, and
    against the torch path over the int8 ones (which dequantizes each gathered context)."""
    quantized = [quantize_caches(k.float(), v.float()) for k, v in caches]
    scale = query.shape[-1] ** -0.5
    kernel, peer = CpuAttentionBackend(load_cpu_kernels()), TorchAttentionBackend()

    def round_of(backend: CpuAttentionBackend | TorchAttentionBackend, layers: list):
        turn = itertools.cycle(layers)
        return lambda: call(backend, next(turn))

    def call(backend: CpuAttentionBackend | TorchAttentionBackend, layer: tuple) -> torch.Tensor:
        key, value, *scales = layer
        return backend.forward(query, key, value, meta, scale, *scales)

    with denormals_flushed():
        ours = best_ms(round_of(kernel, quantized), repeats)
        floats = best_ms(round_of(kernel, caches), repeats)
        theirs = best_ms(round_of(peer, quantized), repeats)
        diff = (call(kernel, quantized[0]) - call(peer, quantized[0])).abs().max().item()
    k, _, ks, _ = quantized[0]
    rows = len(meta.seq_lens_cpu)
    int8_bytes = 2 * rows * meta.seq_lens_cpu[0] * (k.shape[2] * k.shape[3] + 4 * ks.shape[2])
    return {"layout": name, "rows": rows, "positions": meta.seq_lens_cpu[0],
            "layers": len(caches), "kernel_ms": ours, "float_kernel_ms": floats,
            "torch_ms": theirs, "speedup": theirs / ours, "int8_vs_float": floats / ours,
            "kernel_gb_per_s": int8_bytes / ours / 1e6, "max_abs_diff": diff}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_head_args(ap, repeats=40)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--layouts", nargs="+", choices=[*LAYOUTS, *LONG_LAYOUTS, "long"],
                    default=list(LAYOUTS))
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    ap.add_argument("--name", help="results file name (default: decode_attention[-isa][-dtype], "
                    "the ISA where the kernels are not built for this CPU)")
    args = ap.parse_args(argv)
    if load_cpu_kernels() is None:
        raise SystemExit("the C++ CPU kernels are not available here")
    dtype = getattr(torch, args.dtype)
    layouts = {**LAYOUTS, **LONG_LAYOUTS}
    names = [n for name in args.layouts for n in (LONG_LAYOUTS if name == "long" else [name])]
    int8 = args.kv_cache_dtype == "int8"
    runs = [measure(name, *layouts[name], args.heads, args.kv_heads, args.head_dim, dtype,
                    args.repeats, int8) for name in names]
    for r in runs:
        floats = f"  float cache {r['float_kernel_ms']:6.3f} ms" if int8 else ""
        print(f"{r['layout']:30s} kernel {r['kernel_ms']:6.3f} ms "
              f"({r['kernel_gb_per_s']:4.1f} GB/s){floats}  torch {r['torch_ms']:6.3f} ms  "
              f"{r['speedup']:.2f}x")
    isa = target_isa()
    name = args.name or "-".join(filter(None, ["decode_attention",
                                               None if isa == "native" else isa,
                                               None if args.dtype == "float32" else args.dtype,
                                               "int8" if int8 else None]))
    result = {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
              "dtype": args.dtype, "isa": isa, "kv_cache_dtype": args.kv_cache_dtype,
              "runs": runs}
    print(f"wrote {write_result(name, result)}")
    return result


if __name__ == "__main__":
    main()
