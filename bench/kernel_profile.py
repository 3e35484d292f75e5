"""The kernels of one decode step: which ones run, how many, and how much of the step they fill.

Builds the random-weight model of a shape (``bench.model_shapes``; bfloat16 on a GPU) the way
``bench.decode_roofline`` does, runs a few warm-up decode steps, then ``torch.profiler`` over
ONE eager decode forward with its logits and argmax. Eager, not the CUDA graph, so that each
kernel shows as its own launch; the graph replay's time is given beside it. For each batch:

- ``kernels``: device kernel launches in the step (memcpy and memset included);
- ``kernel_us`` against ``profiled_wall_us``: the device's busy time inside the profiled step;
  ``eager_ms`` is the same step timed without the profiler, ``graph_ms`` the CUDA graph's;
- the top kernels by total time: name, calls, total microseconds and share of the kernel time.

On the CPU (``--device cpu --tiny``: a smoke run) the CPU ops take the kernels' place, each
timed by its own (self) time so nested ops are not counted twice.

    python -m bench.kernel_profile --shape llama-3.2-1b --batch 1 --batch 64
    python -m bench.kernel_profile --device cpu --tiny --cpu-kernels off --json /tmp/kp.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile

from bench.decode_roofline import make_llm, model_path, release_memory
from bench.decode_timing import (
    add_decode_args,
    apply_defaults,
    decode_inputs,
    sync,
    time_decode_forward,
)
from tidal.gpu.model_runner import ModelRunner

FULL_DEFAULTS = {"context": 1024, "steps": 8}
TINY_DEFAULTS = {"context": 64, "steps": 8}
TIMED_STEPS = 10  # eager steps timed without the profiler
NAME_WIDTH = 90  # characters of a kernel's name in the Markdown table


@dataclass
class KernelRow:
    name: str
    calls: int
    total_us: float
    share: float  # of the step's kernel time


@dataclass
class BatchProfile:
    batch: int
    context: int
    kernels: int  # device kernel launches (CPU: ops) in the step
    kernel_us: float  # their summed time (CPU: self time)
    profiled_wall_us: float  # the profiled step, synchronized at both ends
    eager_ms: float  # the eager step without the profiler, mean of TIMED_STEPS
    graph_ms: float | None  # the CUDA graph's step (replay, logits, argmax); None without graphs
    top: list[KernelRow] = field(default_factory=list)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.2-1b", help="a bench.model_shapes shape")
    ap.add_argument("--batch", type=int, action="append",
                    help="batch size, repeatable (default 1)")
    ap.add_argument("--context", type=int, help="tokens before the step (1024; tiny: 64)")
    ap.add_argument("--steps", type=int, help="room for this many more tokens (8)")
    ap.add_argument("--tiny", action="store_true", help="the shape's tiny model (CPU smoke run)")
    ap.add_argument("--top", type=int, default=15, help="kernels listed by total time")
    ap.add_argument("--cpu-kernels", choices=["auto", "force", "off"],
                    help="CPU: tidal's C++ kernels or torch's ops (default: the engine's)")
    ap.add_argument("--json", type=Path, help="write the result here as JSON")
    add_decode_args(ap)
    args = ap.parse_args(argv)
    args.batch = args.batch or [1]
    return apply_defaults(args, TINY_DEFAULTS, FULL_DEFAULTS)


def device_events(events: list[FunctionEvent], on_gpu: bool) -> list[tuple[str, float]]:
    """(name, microseconds) of each kernel in ``events``: the device's kernels on a GPU (their
    duration), else the CPU ops (their self time, so a parent op is not counted twice)."""
    if on_gpu:
        return [(e.name, e.time_range.elapsed_us()) for e in events
                if e.device_type == torch.autograd.DeviceType.CUDA]
    return [(e.name, e.self_cpu_time_total) for e in events
            if e.device_type == torch.autograd.DeviceType.CPU
            and not getattr(e, "is_user_annotation", False)]


def top_kernels(kernels: list[tuple[str, float]], count: int) -> list[KernelRow]:
    """``kernels`` grouped by name, the ``count`` with the most total time first."""
    calls: dict[str, int] = {}
    totals: dict[str, float] = {}
    for name, us in kernels:
        calls[name] = calls.get(name, 0) + 1
        totals[name] = totals.get(name, 0.0) + us
    whole = sum(totals.values()) or 1.0
    names = sorted(totals, key=lambda n: -totals[n])[:count]
    return [KernelRow(n, calls[n], totals[n], totals[n] / whole) for n in names]


def eager_step(runner: ModelRunner, batch: int, context: int) -> Callable[[], None]:
    """One decode step run eagerly: forward, logits, argmax (as ``time_decode_forward`` runs
    it, without the graph)."""
    ids, positions, meta = decode_inputs(runner, batch, context)

    def step() -> None:
        hidden = runner.run_model(ids, positions, meta)  # the CPU's one-call step first
        runner.model.compute_logits(hidden).float().argmax(-1)

    return step


def mean_ms(step: Callable[[], None], device: str, iters: int) -> float:
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        step()
    sync(device)
    return 1000 * (time.perf_counter() - start) / iters


def profiled_step(step: Callable[[], None], device: str) -> tuple[list[FunctionEvent], float]:
    """The profiler's events of one ``step`` (CPU, and CUDA on a GPU) and the step's wall
    microseconds, synchronized at both ends."""
    activities = [ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        wall_us = 1e6 * (time.perf_counter() - start)
    return list(prof.events()), wall_us


@torch.inference_mode()
def profile_batch(runner: ModelRunner, batch: int, context: int, warmup: int,
                  top: int) -> BatchProfile:
    device = str(runner.device)
    on_gpu = device.startswith("cuda")
    step = eager_step(runner, batch, context)
    for _ in range(warmup):
        step()
    eager = mean_ms(step, device, TIMED_STEPS)
    profiled_step(step, device)  # the profiler's own first-use costs land in this one
    events, wall_us = profiled_step(step, device)
    kernels = device_events(events, on_gpu)
    graph_ms = (time_decode_forward(runner, batch, context)
                if runner.cuda_graphs is not None else None)
    return BatchProfile(batch, context, len(kernels), sum(us for _, us in kernels), wall_us,
                        eager, graph_ms, top_kernels(kernels, top))


def run(args: argparse.Namespace) -> dict:
    llm = make_llm(model_path(args, args.shape), args, max(args.batch),
                   **({"cpu_kernels": args.cpu_kernels} if args.cpu_kernels else {}))
    runner = llm.engine.executor.runner
    result = {"shape": args.shape + ("-tiny" if args.tiny else ""), "device": args.device,
              "dtype": str(runner.dtype).removeprefix("torch."),
              "unit": "kernel" if args.device.startswith("cuda") else "CPU op",
              "batches": [asdict(profile_batch(runner, b, args.context, args.warmup, args.top))
                          for b in args.batch]}
    del llm, runner
    release_memory(args.device)
    return result


def markdown(result: dict) -> str:
    """The result as Markdown: a line per batch, then its top kernels."""
    unit = result["unit"]
    lines = [f"Kernel profile of one eager decode step: {result['shape']}, {result['dtype']}, "
             f"on {result['device']}."]
    for b in result["batches"]:
        busy = b["kernel_us"] / b["profiled_wall_us"] if b["profiled_wall_us"] else 0.0
        graph = (f"CUDA graph step {b['graph_ms']:.3f} ms" if b["graph_ms"] is not None
                 else "no CUDA graph")
        lines += ["", f"**Batch {b['batch']}** (context {b['context']}): {b['kernels']} "
                  f"{unit}s per step, {b['kernel_us']:.0f} us of {unit} time in a "
                  f"{b['profiled_wall_us']:.0f} us profiled step ({busy:.0%} busy); eager step "
                  f"{b['eager_ms']:.3f} ms unprofiled, {graph}.",
                  "", f"| {unit} | calls | total us | share |", "|---|---:|---:|---:|"]
        for row in b["top"]:
            name = row["name"].replace("|", "\\|")
            name = name if len(name) <= NAME_WIDTH else name[:NAME_WIDTH - 3] + "..."
            lines.append(f"| `{name}` | {row['calls']} | {row['total_us']:.1f} | "
                         f"{row['share']:.1%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = run(args)
    print(markdown(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
