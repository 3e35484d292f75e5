"""Where an engine step's time goes: schedule / prepare inputs / forward / sample / update /
detokenize / post, at steady-state decode for each batch size.

Runs the ``AsyncEngine`` in this process the way the server does (engine thread, consumers on
uvloop), starts ``batch`` requests together, and reads the engine's ``StepProfiler`` over
exactly ``--steps`` decode steps once every request has its first tokens. ``--functions N``
adds the N Python functions with the most own time inside those steps (cProfile on the engine
thread).

    python -m bench.profile_step                      # batch 1 and 32 on the benchmark Llama
    python -m bench.profile_step --model DIR --batch-sizes 1 8 32 --functions 15
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.common import bench_model_dir, write_result
from tidal.app.launch import run_event_loop
from tidal.core.async_engine import AsyncEngine
from tidal.core.config import QUANTIZATIONS, EngineConfig
from tidal.core.sampling_params import SamplingParams
from tidal.core.step_profiler import PHASES, StepProfiler

WARM_TOKENS = 2  # tokens every request has before measuring: its prefill is behind it
SLACK_TOKENS = 8


@dataclass
class Snapshot:
    totals: dict[str, float]
    steps: int
    tokens: int
    wall: float

    @classmethod
    def of(cls, prof: StepProfiler) -> Snapshot:
        return cls(dict(prof.totals), prof.num_steps, prof.num_tokens, time.perf_counter())


@dataclass
class BatchProfile:
    batch_size: int
    steps: int
    step_ms: dict[str, float]  # mean ms per step for each phase, and "total"
    overhead_share: float  # everything but the forward, of the step time
    decode_tok_per_s: float
    top_costs: list[tuple[str, float]]  # (phase, share of step time), largest first
    functions: list[dict[str, Any]] = field(default_factory=list)


def breakdown(before: Snapshot, after: Snapshot, batch_size: int) -> BatchProfile:
    steps = max(after.steps - before.steps, 1)
    ms = {p: 1000 * (after.totals.get(p, 0.0) - before.totals.get(p, 0.0)) / steps
          for p in PHASES}
    total = sum(ms.values())
    ms["total"] = total
    shares = sorted(((p, ms[p] / total if total else 0.0) for p in PHASES),
                    key=lambda item: -item[1])
    return BatchProfile(batch_size, steps, ms,
                        1.0 - ms["forward"] / total if total else 0.0,
                        (after.tokens - before.tokens) / max(after.wall - before.wall, 1e-9),
                        shares)


class _StepWindow:
    """Wraps ``EngineCore.step`` on the engine thread and marks the measured steps there.

    The window opens before the first step at which every request of the batch has its first
    ``WARM_TOKENS`` tokens (prefill behind it) and closes before the ``steps``-th step after
    that, so it holds exactly ``steps`` whole steps, each with its post to the event loop,
    however far the consumers lag. With ``functions``, cProfile runs inside the window.
    """

    def __init__(self, engine: AsyncEngine, request_ids: set[str], steps: int,
                 functions: bool) -> None:
        self.core = engine.core
        self.request_ids = request_ids
        self.steps = steps
        self.profile = cProfile.Profile() if functions else None
        self.start: Snapshot | None = None
        self.end: Snapshot | None = None
        self._seen = 0
        self._step = self.core.step
        self.core.step = self._wrapped  # type: ignore[method-assign]

    def _ready(self) -> bool:
        requests = self.core.scheduler.requests
        return all(rid in requests and requests[rid].num_output_tokens >= WARM_TOKENS
                   for rid in self.request_ids)

    def _wrapped(self, **kwargs: Any) -> list:
        if self.start is None and self._ready():
            self.start = Snapshot.of(self.core.profiler)
        elif self.start is not None and self.end is None:
            self._seen += 1
            if self._seen == self.steps:
                self.end = Snapshot.of(self.core.profiler)
        if self.profile is None or self.start is None or self.end is not None:
            return self._step(**kwargs)
        self.profile.enable()
        try:
            return self._step(**kwargs)
        finally:
            self.profile.disable()

    def close(self) -> None:
        del self.core.step  # back to the class's method

    def top(self, count: int) -> list[dict[str, Any]]:
        if self.profile is None:
            return []
        stats = pstats.Stats(self.profile, stream=io.StringIO())
        rows = []
        for (filename, line, name), (_, calls, own, cumulative, _) in stats.stats.items():
            rows.append({"function": f"{Path(filename).name}:{line}({name})", "calls": calls,
                         "own_s": own, "cumulative_s": cumulative})
        return sorted(rows, key=lambda r: -r["own_s"])[:count]


async def profile_batch(engine: AsyncEngine, batch_size: int, input_len: int, steps: int,
                        functions: int, seed: int) -> BatchProfile:
    rng = random.Random(seed)
    vocab = engine.core.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(input_len)] for _ in range(batch_size)]
    # room past the window: requests whose prefill ended a step early run ahead a little
    params = SamplingParams(temperature=0.0, max_tokens=WARM_TOKENS + steps + SLACK_TOKENS,
                            ignore_eos=True)
    ids = [f"p{seed}-{i}" for i in range(batch_size)]
    window = _StepWindow(engine, set(ids), steps, bool(functions))

    async def consume(request_id: str, prompt: list[int]) -> None:
        async for _ in engine.generate(prompt, params, request_id=request_id):
            pass

    try:
        await asyncio.gather(*(consume(r, p) for r, p in zip(ids, prompts)))
    finally:
        window.close()
    if window.start is None or window.end is None:
        raise RuntimeError(f"batch {batch_size}: the batch never ran {steps} decode steps "
                           "together (too little KV cache or --max-num-seqs?)")
    result = breakdown(window.start, window.end, batch_size)
    result.functions = window.top(functions)
    return result


async def profile(config: EngineConfig, batch_sizes: list[int], input_len: int, steps: int,
                  functions: int) -> list[BatchProfile]:
    engine = AsyncEngine(config)
    engine.start()
    try:
        warm = min(2, config.max_num_seqs)  # a batch that runs together at --max-num-seqs 1
        await profile_batch(engine, warm, input_len, 4, 0, seed=99)  # warm-up
        return [await profile_batch(engine, b, input_len, steps, functions, seed=b)
                for b in batch_sizes]
    finally:
        await engine.shutdown()


def format_profile(p: BatchProfile) -> str:
    lines = [f"batch {p.batch_size}: {p.step_ms['total']:.2f} ms/step over {p.steps} decode "
             f"steps, {p.decode_tok_per_s:.0f} tok/s, overhead (all but forward) "
             f"{100 * p.overhead_share:.1f}%"]
    for phase in PHASES:
        share = p.step_ms[phase] / p.step_ms["total"] if p.step_ms["total"] else 0.0
        lines.append(f"  {phase:<15} {p.step_ms[phase]:8.3f} ms  {100 * share:5.1f}%")
    top = ", ".join(f"{name} {100 * share:.1f}%" for name, share in p.top_costs[:3])
    lines.append(f"  top costs: {top}")
    if p.functions:
        lines.append("  functions with the most own time in the measured steps:")
        for row in p.functions:
            lines.append(f"    {1000 * row['own_s'] / p.steps:7.3f} ms/step  "
                         f"{row['calls'] // p.steps:>6} calls/step  {row['function']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[BatchProfile]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="HF model directory (default: the random ~30M Llama)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64, help="decode steps measured per batch")
    ap.add_argument("--functions", type=int, default=0,
                    help="also list this many functions by own time (cProfile slows steps)")
    ap.add_argument("--dtype", default="auto",
                    choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                    help="weight-only quantization of the decoder layers' linears at load")
    ap.add_argument("--kv-cache-memory", type=int, default=None, help="bytes")
    ap.add_argument("--out", default="profile_step",
                    help="results basename in bench/results ('' to skip writing)")
    args = ap.parse_args(argv)
    model = args.model or str(bench_model_dir(Path(tempfile.gettempdir()) / "tidal-bench-llama"))
    config = EngineConfig(model=model, dtype=args.dtype,
                          max_num_seqs=args.max_num_seqs or max(args.batch_sizes),
                          kv_cache_memory=args.kv_cache_memory, quantization=args.quantization)
    results = run_event_loop(profile(config, args.batch_sizes, args.input_len, args.steps,
                                  args.functions))
    for result in results:
        print(format_profile(result))
    if args.out:
        path = write_result(args.out, {"model": model, "dtype": args.dtype,
                                       "quantization": args.quantization,
                                       "input_len": args.input_len,
                                       "profiles": [asdict(r) for r in results]})
        print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
