"""Pipeline parallelism on this host: one process against two stages, the stages running one
step at a time (the pipe drained after every step) and with a micro-batch per stage in flight.

Each layout generates ``--output-len`` tokens for each of ``--concurrency`` prompts submitted
at once (offline ``LLM.generate``: every request in the batch, as a server at that concurrency
has them); its throughput is the output tokens over the wall time, and its time per output token the
time of the whole run less that of a one-token run, over the steps between. The two stages
split the cores between them, as tensor-parallel ranks do. The model's weights exceed the
last-level cache, so a step reads them from memory, as a GPU's step does.

    python -m bench.pipeline_parallel                # llama-28m, c32, 128 in / 64 out
    python -m bench.pipeline_parallel --quick        # a smoke run: c32, 16 in / 8 out, one pass
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from bench.common import RESULTS_DIR, decode_timings, host_line, machine, write_result
from bench.model_shapes import build_shaped_model_dir
from tidal.core import LLM

# (name, pipeline stages, micro-batches in flight)
LAYOUTS = [("one process", 1, 1), ("2 stages, one step at a time", 2, 1),
           ("2 stages, micro-batches", 2, 2)]


def measure(model: str, stages: int, micro_batches: int, concurrency: int, input_len: int,
            output_len: int, passes: int) -> dict[str, float]:
    """Throughput and decode step of one layout (best of ``passes``)."""
    llm = LLM(model, pipeline_parallel_size=stages, max_num_seqs=concurrency,
              max_model_len=1024, max_num_batched_tokens=max(512, concurrency))
    llm.engine.scheduler.config.micro_batches = micro_batches  # 1: each step drains the pipe
    whole, first = decode_timings(llm, concurrency, input_len, output_len, passes)
    return {"output_tok_s": concurrency * output_len / whole,
            "tpot_ms": 1000 * (whole - first) / (output_len - 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-28m")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="16 in / 8 out, one pass")
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    if args.quick:
        args.input_len, args.output_len, args.passes = 16, 8, 1
    model = str(build_shaped_model_dir(Path(tempfile.gettempdir()) / f"tidal-bench-{args.shape}",
                                       args.shape))
    load_before = os.getloadavg()
    rows = [{"layout": name, "stages": stages, "micro_batches": mb,
             **measure(model, stages, mb, args.concurrency, args.input_len, args.output_len,
                       args.passes)}
            for name, stages, mb in LAYOUTS]
    name = args.name or f"pipeline_parallel-{args.shape}" + ("-quick" if args.quick else "")
    result = {"shape": args.shape, "concurrency": args.concurrency,
              "input_len": args.input_len, "output_len": args.output_len, "rows": rows,
              "machine": machine(), "load_before": load_before, "load_after": os.getloadavg()}
    write_result(name, result)
    text = report(name, result)
    (RESULTS_DIR / f"{name}.md").write_text(text)
    print(text)


def report(name: str, result: dict) -> str:
    base = result["rows"][0]["output_tok_s"]
    lines = [f"# {name}", "", f"Host: {host_line(result['machine'])}; load average before "
             f"{result['load_before'][0]:.1f}, after {result['load_after'][0]:.1f}.", "",
             f"`{result['shape']}`, {result['concurrency']} requests at once, "
             f"{result['input_len']} tokens in and {result['output_len']} out, greedy.", "",
             "| layout | output tok/s | vs one process | ms per output token |",
             "|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['layout']} | {r['output_tok_s']:.1f} | "
                     f"{r['output_tok_s'] / base:.2f}x | {r['tpot_ms']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
