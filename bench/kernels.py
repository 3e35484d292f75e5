"""Every CPU op of a model, every candidate, at every row bucket: the times the selector sees on
this host and the winner it keeps, so anyone can see what their CPU picks.

Times are fresh (a throw-away plan cache), taken as the server takes them at start: random
inputs of the model's shapes, each candidate's best call. ``TIDAL_CPU_ISA=x86-64-v3`` builds the
kernels for the AVX2 baseline instead of this CPU, to see here what an AVX2 host would run.

    python -m bench.kernels                          # the benchmark Llama, float32
    python -m bench.kernels --model default --dtype bfloat16 --max-rows 1024
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from bench.common import bench_model_dir, write_result
from gpu.attention import get_attention_backend
from gpu.cpu import selector
from gpu.cpu.host import describe
from gpu.cpu.kernels import target_isa
from gpu.cpu.selector import PlanCache
from gpu.model_config import ModelConfig
from gpu.model_loader import prepare_for_cpu, read_model


def resolve(model: str) -> Path:
    if model == "bench":
        return bench_model_dir(Path(tempfile.gettempdir()) / "tidal-bench-llama")
    if model == "default":
        from core.config import DEFAULT_MODEL

        return Path(DEFAULT_MODEL)
    return Path(model)


def print_table(plans: dict[str, dict]) -> None:
    for name, plan in sorted(plans.items()):
        print(f"\n{name} (ms)")
        names = sorted({n for t in plan["timings"] for n in t})
        print(f"  {'rows':>6s}  " + "  ".join(f"{n:>9s}" for n in names) + "  winner")
        for rows, times, choice in zip(plan["bounds"], plan["timings"], plan["choices"]):
            cells = "  ".join(f"{times[n]:9.3f}" if n in times else f"{'-':>9s}" for n in names)
            print(f"  {rows:6d}  {cells}  {choice}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench",
                    help="'bench' (the benchmark Llama), 'default' (the embedded model) or a "
                    "model directory")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--max-rows", type=int, default=192,
                    help="the token budget to time up to (the server's default on a CPU)")
    ap.add_argument("--max-seqs", type=int, default=64)
    ap.add_argument("--name", help="results file name (default: kernels-<isa>[-dtype])")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    print(f"host: {describe()}; kernels built for -march={target_isa()}; "
          f"{torch.get_num_threads()} threads")
    model_dir = resolve(args.model)
    cfg = ModelConfig.from_dir(model_dir)
    model = read_model(model_dir, cfg, get_attention_backend("cpu", "cpu"), 4096, dtype, "cpu")
    selector.set_mode("auto")
    with tempfile.TemporaryDirectory() as tmp:
        result = prepare_for_cpu(model, args.max_rows, args.max_seqs, PlanCache(Path(tmp)))
    plans = {name: plan.to_json() for name, plan in result.plans.items()}
    print_table(plans)
    print(f"\ntimed in {result.seconds:.1f} s")
    name = args.name or "-".join(filter(None, ["kernels", target_isa(),
                                               None if args.dtype == "float32" else args.dtype]))
    out = {"model": args.model, "dtype": args.dtype, "isa": target_isa(), "host": describe(),
           "max_rows": args.max_rows, "max_seqs": args.max_seqs, "plans": plans}
    print(f"wrote {write_result(name, out)}")
    return out


if __name__ == "__main__":
    main()
