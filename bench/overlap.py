"""How much of the engine's CPU time per step the overlap hides.

With overlap on, the engine schedules and prepares step N+1 while the device runs step N, and
processes step N's tokens (stop checks, detokenization, outputs) while step N+1 runs. At each
batch size, on a random-weight Llama in a real model's shape:

- ``step_ms_overlap_on`` / ``step_ms_overlap_off``: engine step time while all requests decode;
- ``gpu_ms``: the step's device work alone (forward, logits, argmax back to back);
- ``cpu_ms``: the engine's CPU time per step, ``step_ms_overlap_off - gpu_ms`` (without overlap
  the two run one after the other);
- ``hidden_share``: the part of ``cpu_ms`` overlap removes from the step,
  ``(off - on) / cpu_ms``; and the profiler's phase times in both modes.

    python -m bench.overlap                        # GPU: qwen2.5-0.5b shape, batch 1/32/128
    python -m bench.overlap --device cpu --tiny    # smoke run of the script on the CPU

On the CPU the device work is synchronous, so overlap hides nothing there. Writes
``bench/results/overlap-<device>.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.common import write_result
from bench.decode_roofline import make_llm, model_path, release_memory
from bench.decode_timing import (
    add_decode_args,
    apply_defaults,
    device_slug,
    time_decode_forward,
    time_engine_decode,
)

FULL_DEFAULTS = {"batches": "1,32,128", "context": 512, "steps": 64}
TINY_DEFAULTS = {"batches": "1,4,8", "context": 64, "steps": 8}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--batches", help="comma-separated (default 1,32,128; tiny: 1,4,8)")
    ap.add_argument("--context", type=int, help="prompt tokens per request (512; tiny: 64)")
    ap.add_argument("--steps", type=int, help="decode steps timed (64; tiny: 8)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke run)")
    add_decode_args(ap)
    args = ap.parse_args(argv)
    return apply_defaults(args, TINY_DEFAULTS, FULL_DEFAULTS)


def measure(args: argparse.Namespace, batches: list[int], overlap: bool) -> dict[int, dict]:
    llm = make_llm(model_path(args, args.shape), args, max(batches),
                   async_scheduling=overlap)
    out = {}
    for batch in batches:
        out[batch] = time_engine_decode(llm, batch, args.context, args.steps, args.warmup)
        if overlap:  # the device work does not depend on the mode: time it once
            context = args.context + 1 + args.warmup + args.steps // 2
            runner = llm.engine.executor.runner
            out[batch]["gpu_ms"] = time_decode_forward(runner, batch, context)
    del llm
    release_memory(args.device)
    return out


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    on = measure(args, batches, overlap=True)
    off = measure(args, batches, overlap=False)
    rows = []
    for batch in batches:
        step_on, step_off, gpu = on[batch]["step_ms"], off[batch]["step_ms"], on[batch]["gpu_ms"]
        cpu = max(0.0, step_off - gpu)
        row = {"batch": batch, "step_ms_overlap_on": step_on, "step_ms_overlap_off": step_off,
               "gpu_ms": gpu, "cpu_ms": cpu, "hidden_ms": step_off - step_on,
               "hidden_share": (step_off - step_on) / cpu if cpu > 0 else None,
               "phases_ms_overlap_on": on[batch]["phases_ms"],
               "phases_ms_overlap_off": off[batch]["phases_ms"]}
        rows.append(row)
        share = "n/a" if row["hidden_share"] is None else f"{100 * row['hidden_share']:.0f}%"
        print(f"batch {batch:>4}: step {step_on:8.3f} ms with overlap, {step_off:8.3f} ms "
              f"without; gpu {gpu:8.3f} ms, cpu {cpu:8.3f} ms, hidden {share}")
    suffix = device_slug(args.device) + ("-tiny" if args.tiny else "")
    path = write_result(f"overlap-{suffix}", {"settings": vars(args), "rows": rows})
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
