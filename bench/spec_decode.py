"""Speculative decoding's speed: output tok/s with n-gram, suffix and draft-model proposals
against none, on the same model, prompts and greedy settings, at c1 (one request at a time)
and c32 (32 at once), each configuration in a fresh process. Prints and writes
``bench/results/spec_decode.json``.

Two workloads:
- ``repeating``: the benchmark Llama (~30M parameters, float32) with its attention and MLP
  output projections zeroed, so its next token is a function of the current one (every layer
  still runs at full cost). Each prompt is a random passage ``P``, the model's own greedy
  continuation ``G`` of it, and ``P`` again: the reply then repeats ``G``, text already in its
  prompt, as an edit of code or a quoted document repeats its source. A random model cannot
  copy the way a trained one does, and the embedded model did not learn to (fine-tuning it on
  passages given twice did not make it repeat text); this stands in for such a model.
- ``embedded``: the embedded default model on Tiny Shakespeare passages, each given twice, the
  second copy cut short: the model's own continuation decides how much is accepted. Only this
  workload runs ``draft_model``: the embedded model ships its draft (``core/default_model/draft``).

    python -m bench.spec_decode [--output-len 128] [--workloads repeating embedded]
        [--async-scheduling] [--methods none ngram suffix draft_model suffix-16-f2 ...]
        [--repeats 3] [--device cuda]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench.common import bench_model_dir, random_prompts, write_result

METHODS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
              "prompt_lookup_max": 3},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 4},
}
# longer proposals where the match is long, for the copy workload (``--methods``)
EXTRA_METHODS: dict[str, dict[str, Any]] = {
    "ngram-long": {"method": "ngram", "num_speculative_tokens": 16, "prompt_lookup_min": 2,
                   "prompt_lookup_max": 8},
    "suffix-16": {"method": "suffix", "num_speculative_tokens": 16},
    "suffix-16-f2": {"method": "suffix", "num_speculative_tokens": 16,
                     "suffix_decoding_max_spec_factor": 2.0},
    "suffix-24-f4": {"method": "suffix", "num_speculative_tokens": 24,
                     "suffix_decoding_max_spec_factor": 4.0},
}
SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared/data/tinyshakespeare.txt"


def repeating_model(root: Path) -> Path:
    """The benchmark Llama with its o_proj and down_proj zeroed."""
    from safetensors.torch import load_file, save_file

    path = root / "repeating"
    if (path / "config.json").is_file():
        return path
    bench_model_dir(path)
    weights = load_file(path / "model.safetensors")
    for name in weights:
        if "o_proj" in name or "down_proj" in name:
            weights[name] = weights[name] * 0.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def prompts_for(workload: str, model: str, num: int, output_len: int,
                device: str = "cpu") -> list[Any]:
    if workload == "repeating":
        passages = random_prompts(num, 64, 128, 8192, seed=3)
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(1, mp_context=ctx) as pool:
            replies = pool.submit(continuations, model, passages, output_len, device).result()
        return [p + g + p for p, g in zip(passages, replies)]
    text = SHAKESPEARE.read_text() if SHAKESPEARE.is_file() else ""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    out = []
    for i in range(num):
        passage = text[4000 * i + 1000:4000 * i + 1600] or f"To be, or not to be {i}. " * 20
        ids = tokenizer.encode(passage, add_special_tokens=False)[:96]
        out.append(ids + ids[:24])  # the passage, then its start again
    return out


def continuations(model: str, prompts: list[Any], output_len: int,
                  device: str = "cpu") -> list[list[int]]:
    """The model's greedy continuation of each prompt."""
    from tidal.core import LLM, SamplingParams

    llm = LLM(model, device=device, max_num_seqs=32)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def run_one(model: str, spec: dict | None, prompts: list[Any], concurrency: int,
            output_len: int, async_scheduling: bool | None = None,
            device: str = "cpu") -> dict[str, Any]:
    """In a fresh process: a warm-up, then the prompts ``concurrency`` at a time (in the
    device's default dtype: float32 on the CPU, bfloat16 on a GPU)."""
    from tidal.core import LLM, SamplingParams

    llm = LLM(model, device=device, max_num_seqs=max(concurrency, 1),
              speculative_config=spec, async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:concurrency], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(prompts), concurrency):
        outs = llm.generate(prompts[i:i + concurrency], params, use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    seconds = time.perf_counter() - start
    stats = llm.engine.stats()
    drafted = stats.spec_decode_num_draft_tokens
    return {"output_tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens,
            "draft_tokens": drafted, "accepted_tokens": stats.spec_decode_num_accepted_tokens,
            "trimmed_tokens": stats.spec_decode_num_trimmed_tokens,
            "acceptance": stats.spec_decode_num_accepted_tokens / drafted if drafted else None}


def measure(model: str, prompts: list[Any], concurrency: int, output_len: int,
            methods: dict[str, dict[str, Any] | None] = METHODS,
            async_scheduling: bool | None = None, repeats: int = 1, device: str = "cpu"
            ) -> dict[str, dict[str, Any]]:
    """Each method's run, ``repeats`` rounds of every method in turn (so a slow moment of the
    host falls on one round, not one method); a ratio against none is taken within a round,
    and the median round's is reported."""
    rounds: list[dict[str, dict[str, Any]]] = []
    ctx = multiprocessing.get_context("spawn")
    for _ in range(repeats):
        row: dict[str, dict[str, Any]] = {}
        for name, spec in methods.items():
            if name == "draft_model" and not (Path(model) / "draft" / "config.json").is_file():
                continue  # no draft ships with this model
            with ProcessPoolExecutor(1, mp_context=ctx) as pool:
                row[name] = pool.submit(run_one, model, spec, prompts, concurrency,
                                        output_len, async_scheduling, device).result()
            row[name]["vs_none"] = row[name]["output_tok_s"] / row["none"]["output_tok_s"]
            print(f"  c{concurrency} {name:7s} {row[name]['output_tok_s']:8.1f} tok/s "
                  f"{row[name]['vs_none']:.2f}x acceptance {row[name]['acceptance']}",
                  flush=True)
        rounds.append(row)
    return {name: _median_round([r[name] for r in rounds]) for name in rounds[0]}


def _median_round(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median ratio against none, with every round's ratio beside it."""
    ranked = sorted(runs, key=lambda run: run["vs_none"])
    return {**ranked[(len(ranked) - 1) // 2],
            "rounds_vs_none": [round(run["vs_none"], 4) for run in runs],
            "rounds_tok_s": [round(run["output_tok_s"], 1) for run in runs]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["repeating", "embedded"],
                    choices=["repeating", "embedded"])
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--c1-requests", type=int, default=16)
    ap.add_argument("--c32-requests", type=int, default=256)
    ap.add_argument("--name", default="spec_decode")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 32], choices=[1, 32])
    ap.add_argument("--methods", nargs="+", choices=[*METHODS, *EXTRA_METHODS],
                    help="the configurations to run, none first (default: none ngram suffix "
                    "draft_model)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds of every method in turn; the median round's ratio is kept")
    ap.add_argument("--device", default="cpu", help="'cpu' or 'cuda' (with CUDA graphs)")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="for every configuration, none's included (default: the engine's)")
    args = ap.parse_args(argv)
    from tidal.core.config import DEFAULT_MODEL

    known = {**METHODS, **EXTRA_METHODS}
    methods = ({"none": None} | {m: known[m] for m in args.methods} if args.methods
               else METHODS)
    result: dict[str, Any] = {"output_len": args.output_len, "requests": {
                                  "c1": args.c1_requests, "c32": args.c32_requests},
                              "methods": methods,
                              "async_scheduling": args.async_scheduling,
                              "repeats": args.repeats, "device": args.device,
                              "load_before": list(os.getloadavg())}
    with tempfile.TemporaryDirectory() as tmp:
        for workload in args.workloads:
            model = (str(repeating_model(Path(tmp))) if workload == "repeating"
                     else str(DEFAULT_MODEL))
            print(workload, flush=True)
            result[workload] = {
                f"c{c}": measure(model, prompts_for(workload, model, n, args.output_len,
                                                    args.device),
                                 c, args.output_len, methods, args.async_scheduling,
                                 args.repeats, args.device)
                for c, n in ((1, args.c1_requests), (32, args.c32_requests))
                if c in args.concurrency}
    result["load_after"] = list(os.getloadavg())
    print(write_result(args.name, result))


if __name__ == "__main__":
    main()
