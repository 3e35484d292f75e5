"""Every CPU op of a model, every candidate, at every row bucket: the times the selector sees on
this host and the winner it keeps, so anyone can see what their CPU picks.

Times are fresh (a throw-away plan cache), taken as the server takes them at start: random
inputs of the model's shapes, each candidate's best call. ``TIDAL_CPU_ISA=x86-64-v3`` builds the
kernels for the AVX2 baseline instead of this CPU, to see here what an AVX2 host would run.

    python -m bench.kernels                          # the benchmark Llama, float32
    python -m bench.kernels --model default --dtype bfloat16 --max-rows 1024
    python -m bench.kernels --quant int8 int4g32     # its quantized linears, each format
    python -m bench.kernels --quant int4g32 --stream # and a batch-1 pass over weights past L3

With ``--quant``, each format's linears are timed as a quantized model's are at start (tidal's
kernel, torch's fused int8/int4 ops and the dequantizing path), written to
``kernels-quant-<isa>.json``; ``--stream`` adds the rate at which one row streams a stack of
Llama-7B-shaped quantized weights (larger than a server CPU's L3) by each method, beside the
host's streaming read rate (``bench/offline_floor.py``'s ``HostRates``).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from bench.common import bench_model_dir, write_result
from tidal.gpu.attention import get_attention_backend
from tidal.gpu.cpu import selector
from tidal.gpu.cpu.backend import prepare_for_cpu
from tidal.gpu.cpu.host import describe
from tidal.gpu.cpu.kernels import target_isa
from tidal.gpu.cpu.selector import PlanCache
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.model_loader import LoadOptions, read_model
from tidal.gpu.quantization.linear import QuantLinear, candidate_methods
from tidal.gpu.quantization.planner import plan_quant_linears
from tidal.gpu.quantization.weights import QuantizedWeight

QUANT_FORMATS = {"int8": ("int8", 32), "int4g32": ("int4", 32), "int4g64": ("int4", 64),
                 "int4g128": ("int4", 128)}
# A Llama-7B layer's linears (qkv, o, gate_up, down) as [out, in]: STREAM_LAYERS of them hold
# 405 MB in int4, past the L3 of the hosts this runs on, so a pass reads them from memory.
STREAM_SHAPES = [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)]
STREAM_LAYERS = 4


def resolve(model: str) -> Path:
    if model == "bench":
        return bench_model_dir(Path(tempfile.gettempdir()) / "tidal-bench-llama")
    if model == "default":
        from tidal.core.config import DEFAULT_MODEL

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


def quant_plans(model_dir: Path, cfg: ModelConfig, fmt: str, max_rows: int) -> dict:
    """Every quantized linear shape of the model in ``fmt``, timed with a fresh plan cache."""
    method, group = QUANT_FORMATS[fmt]
    model = read_model(model_dir, cfg, LoadOptions(get_attention_backend("cpu", "cpu"), 4096,
                                                   torch.float32, "cpu", quantization=method,
                                                   group_size=group))
    with tempfile.TemporaryDirectory() as tmp:
        plans = plan_quant_linears(model, max_rows, PlanCache(Path(tmp)))
    return {name: plan.to_json() for name, plan in plans.items()}


def _random_weight(n: int, k: int, fmt: str) -> QuantizedWeight:
    bits = 8 if fmt == "int8" else 4
    group = k if fmt == "int8" else QUANT_FORMATS[fmt][1]
    q = (torch.randint(-127, 128, (n, k), dtype=torch.int8) if bits == 8
         else torch.randint(0, 16, (n, k), dtype=torch.uint8))
    scales = torch.rand(n, k // group) * 0.01
    return QuantizedWeight(bits, group, q, scales, None if bits == 8 else -8 * scales)


def stream_rates(fmt: str, repeats: int = 5) -> dict[str, float]:
    """GB/s of the weight bytes in one batch-1 pass over ``STREAM_LAYERS`` layers of
    ``STREAM_SHAPES``, by each method that takes the format (the best of ``repeats`` passes),
    one method's layers built at a time."""
    sample = _random_weight(*STREAM_SHAPES[0], fmt)
    rates = {}
    for method in candidate_methods(sample, torch.device("cpu")):
        if method == selector.TORCH:
            continue  # dequantizes the whole weight each call: not a streaming path
        nbytes, ms = _stream_pass(fmt, method, repeats)
        rates[method] = round(nbytes / ms / 1e6, 2)
        print(f"  {fmt} {method}: {nbytes / 1e6:.0f} MB of weights in {ms:.2f} ms, "
              f"{rates[method]:.1f} GB/s")
    return rates


def _stream_pass(fmt: str, method: str, repeats: int) -> tuple[int, float]:
    """(weight bytes, best ms) of one row through every stream layer's linears by ``method``."""
    layers, nbytes = [], 0
    for _ in range(STREAM_LAYERS):
        for n, k in STREAM_SHAPES:
            w = _random_weight(n, k, fmt)
            nbytes += w.nbytes
            layer = QuantLinear(w, plan=selector.Plan.always(selector.TORCH))  # packs nothing
            layer.replan(selector.Plan.always(method))  # packs and drops the values
            layers.append(layer)
    xs = {k: torch.randn(1, k) for _, k in STREAM_SHAPES}
    return nbytes, selector.best_ms(lambda: [m(xs[m.in_features]) for m in layers], repeats)


def quant_main(args: argparse.Namespace, model_dir: Path, cfg: ModelConfig) -> dict:
    out: dict = {"model": args.model, "isa": target_isa(), "host": describe(),
                 "threads": torch.get_num_threads(), "max_rows": args.max_rows, "formats": {}}
    for fmt in args.quant:
        plans = quant_plans(model_dir, cfg, fmt, args.max_rows)
        print(f"\n== {fmt}")
        print_table(plans)
        out["formats"][fmt] = plans
    if args.stream:
        from bench.offline_floor import HostRates

        rate = HostRates.measure("cpu", "float32").read_bytes_per_s
        print(f"\nhost streaming read: {rate / 1e9:.1f} GB/s")
        out["stream"] = {"shapes": STREAM_SHAPES, "layers": STREAM_LAYERS,
                         "host_read_gb_s": round(rate / 1e9, 2),
                         "gb_s": {fmt: stream_rates(fmt) for fmt in args.quant}}
    print(f"wrote {write_result(args.name or f'kernels-quant-{target_isa()}', out)}")
    return out


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
    ap.add_argument("--quant", nargs="+", choices=sorted(QUANT_FORMATS),
                    help="time the quantized linears of these formats instead (float32 x)")
    ap.add_argument("--stream", action="store_true",
                    help="with --quant: a batch-1 pass over weights larger than the L3")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    print(f"host: {describe()}; kernels built for -march={target_isa()}; "
          f"{torch.get_num_threads()} threads")
    model_dir = resolve(args.model)
    cfg = ModelConfig.from_dir(model_dir)
    selector.set_mode("auto")
    if args.quant:
        return quant_main(args, model_dir, cfg)
    model = read_model(model_dir, cfg,
                       LoadOptions(get_attention_backend("cpu", "cpu"), 4096, dtype, "cpu"))
    with tempfile.TemporaryDirectory() as tmp:
        result = prepare_for_cpu(model, args.max_rows, args.max_seqs,
                                 PlanCache(Path(tmp))).plans
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
