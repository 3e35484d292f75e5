"""Tensor parallelism on this host: the decode step of one process against N ranks (the cores
split between them), beside what the collectives alone cost and the step that predicts.

Each layout decodes ``--output-len`` tokens for batches of ``--batches`` prompts; a step's time
is the decode time over its steps (the run of one token, its prefill, subtracted). The
collectives are timed between ``N`` gloo processes on loopback: the all-reduce of a step's
``rows x hidden`` activations and the all-gather of its logits. The prediction for N ranks is
one process's step over N plus ``2 x layers + 1`` all-reduces and one all-gather.

    python -m bench.tensor_parallel --shape llama-28m --tp 1 2 --batches 1 32
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import (
    RESULTS_DIR,
    decode_timings,
    host_line,
    machine,
    time_ms,
    write_result,
)
from bench.model_shapes import build_shaped_model_dir
from tidal.core import LLM
from tidal.gpu.model_config import ModelConfig


def decode_step_ms(model: str, tp: int, batch: int, input_len: int, output_len: int) -> float:
    llm = LLM(model, tensor_parallel_size=tp, max_num_seqs=batch, max_model_len=1024)
    whole, first = decode_timings(llm, batch, input_len, output_len)
    return 1000 * (whole - first) / (output_len - 1)


def _collective_ranks(rank: int, size: int, port: int, shapes: list[tuple[int, int, int]],
                      out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    for rows, hidden, vocab in shapes:
        x = torch.randn(rows, hidden)
        logits = torch.randn(rows, -(-vocab // size))
        parts = [torch.empty_like(logits) for _ in range(size)]
        reduce_ms = time_ms(lambda x=x: dist.all_reduce(x), 300)
        gather_ms = time_ms(lambda p=parts, g=logits: dist.all_gather(p, g), 300)
        if rank == 0:
            out[rows] = {"all_reduce_ms": reduce_ms, "all_gather_ms": gather_ms}
    dist.destroy_process_group()


def collectives(size: int, cfg: ModelConfig, batches: list[int]) -> dict[int, dict]:
    from tidal.gpu.multiproc_executor import _free_port

    with mp.Manager() as manager:
        out = manager.dict()
        shapes = [(b, cfg.hidden_size, cfg.vocab_size) for b in batches]
        mp.spawn(_collective_ranks, args=(size, _free_port(), shapes, out), nprocs=size)
        return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-28m")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    model = str(build_shaped_model_dir(Path(tempfile.gettempdir()) / f"tidal-bench-{args.shape}",
                                       args.shape))
    cfg = ModelConfig.load(model)
    steps = {tp: {b: decode_step_ms(model, tp, b, args.input_len, args.output_len)
                  for b in args.batches} for tp in args.tp}
    comms = {tp: collectives(tp, cfg, args.batches) for tp in args.tp if tp > 1}
    rows = []
    for tp in args.tp:
        for b in args.batches:
            row = {"tp": tp, "batch": b, "step_ms": steps[tp][b]}
            if tp > 1:
                c = comms[tp][b]
                comm = (2 * cfg.num_layers + 1) * c["all_reduce_ms"] + c["all_gather_ms"]
                row |= {**c, "collectives_ms": comm,
                        "predicted_ms": steps[args.tp[0]][b] / tp + comm}
            rows.append(row)
    name = args.name or f"tensor_parallel-{args.shape}"
    layout = {"threads_per_rank": {tp: max(1, (os.cpu_count() or 1) // tp) for tp in args.tp},
              "transport": "gloo over loopback (one machine)"}
    write_result(name, {"shape": args.shape, "layout": layout, "rows": rows,
                        "load_average": os.getloadavg()})
    (RESULTS_DIR / f"{name}.md").write_text(report(name, args.shape, rows))
    print(report(name, args.shape, rows))


def report(name: str, shape: str, rows: list[dict]) -> str:
    lines = [f"# {name}", "", f"Host: {host_line(machine())}", "",
             f"Decode steps of the `{shape}` shape, float32, one process against N ranks "
             "(gloo on loopback, the cores split between them).", "",
             "| ranks | batch | step ms | all-reduce ms | all-gather ms | collectives ms "
             "| predicted ms |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        extra = ([f"{r[k]:.3f}" for k in ("all_reduce_ms", "all_gather_ms", "collectives_ms",
                                          "predicted_ms")] if r["tp"] > 1 else [""] * 4)
        lines.append(f"| {r['tp']} | {r['batch']} | {r['step_ms']:.2f} | " + " | ".join(extra)
                     + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
