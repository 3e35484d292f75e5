"""The KV cache's second tier (``--kv-offload-size``, ``--kv-offload-path``), offline on the
benchmark Llama, two workloads:

- chat: conversations taken in turn, one request at a time, each turn's prompt the whole
  conversation so far; together they outgrow the device cache (``--kv-cache-blocks``), so a
  returning turn finds its earlier turns evicted. Its TTFT (p50, p90) without the tier, with
  the host tier, and with the host tier spilling to disk.
- preemption: a batch that preempts itself all through the run: short prompts (64 tokens)
  and long outputs (448) on a device cache of 64 blocks (``--preempt-kv-cache-blocks``), so
  the prompts all fit at once and their growth then runs the cache out again every few
  blocks; the latest arrival is preempted, and the others' growth pushes its blocks out to
  the host tier while it waits for room (dozens of preemptions, nearly every one resumed
  from the tier). Output tokens/s when every
  resumption copies its blocks back (swap), when every one recomputes them, and when the
  engine chooses by measurement; with the preemptions, resumptions by method, blocks swapped
  in and out, the tokens prefilled (first prompts and recomputed ones) and what the choice
  compares (the measured milliseconds per token brought back by a copy or by a prefill).
  A few preemptions in a long run (long prompts, short outputs) leave both ways a small part
  of its time, which says nothing about either.

Prints both of the issue's ratios: returning turns' TTFT p50 with the host tier over without
(target: at most 0.5) and output tok/s resuming by swap over by recompute (target: 1.2).

    python -m bench.kv_tier [--conversations 12] [--turns 4] [--kv-cache-blocks 64]
    python -m bench.kv_tier --model DIR --quantization int8 --skip chat   # a larger model

Writes ``bench/results/kv_tier-<host>.json`` (``--name`` to change), the host's details in it.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import bench_model_dir, machine, random_prompts, write_result
from tidal.core.config import QUANTIZATIONS
from tidal.core.llm import LLM
from tidal.core.sampling_params import SamplingParams
from tidal.gpu.model_config import ModelConfig


def _block_bytes(model: str, args: argparse.Namespace) -> int:
    """A 16-token block's bytes in the engine's dtype (by default float32 on a CPU, bfloat16
    on a GPU)."""
    wide = args.dtype == "float32" or (args.dtype == "auto" and args.device == "cpu")
    return 16 * ModelConfig.from_dir(Path(model)).kv_bytes_per_token(4 if wide else 2)


def _weights(args: argparse.Namespace) -> dict[str, Any]:
    return {"dtype": args.dtype, "quantization": args.quantization}


def _engine(model: str, args: argparse.Namespace, **tiers: Any) -> LLM:
    return LLM(model, device=args.device, **_weights(args),
               kv_cache_memory=args.kv_cache_blocks * _block_bytes(model, args), **tiers)


def _p(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return 1000 * values[min(len(values) - 1, int(q * len(values)))]


def chat(model: str, args: argparse.Namespace, **tiers: Any) -> dict[str, Any]:
    """Returning turns' TTFT (ms) over the conversations taken in turn."""
    llm = _engine(model, args, **tiers)
    turns = random_prompts(args.conversations * args.turns, args.turn_len, args.turn_len,
                           vocab=llm.engine.vocab_size, seed=1)
    params = SamplingParams(max_tokens=args.reply_len, temperature=0.0, ignore_eos=True)
    history: list[list[int]] = [[] for _ in range(args.conversations)]
    llm.generate([3] * args.turn_len, params, use_tqdm=False)  # warm up, untimed
    first, returning, cached = [], [], 0
    for turn in range(args.turns):
        for c in range(args.conversations):
            prompt = history[c] + turns[turn * args.conversations + c]
            out = llm.generate(prompt, params, use_tqdm=False)[0]
            (stats,) = out.finished_stats
            ttft = stats.times.first_token - stats.times.arrival
            (returning if turn else first).append(ttft)
            cached += out.num_cached_tokens if turn else 0
            history[c] = prompt + out.outputs[0].token_ids
    stats = llm.engine.stats()
    llm.shutdown()
    return {"returning_ttft_p50_ms": _p(returning, 0.5), "returning_ttft_p90_ms":
            _p(returning, 0.9), "first_turn_ttft_p50_ms": _p(first, 0.5),
            "returning_cached_tokens": cached, "host_tier_hits": stats.host_tier_hits,
            "disk_tier_hits": stats.disk_tier_hits}


def preemption(model: str, args: argparse.Namespace, method: str) -> dict[str, Any]:
    """Output tokens/s of a batch that preempts itself, resuming by ``method``."""
    block = _block_bytes(model, args)
    llm = LLM(model, device=args.device, **_weights(args),
              kv_cache_memory=args.preempt_kv_cache_blocks * block,
              kv_offload_size=args.host_blocks * block, max_num_seqs=args.concurrency)
    if method != "measured":
        llm.engine.kv.swap_policy.swap = lambda *_: method == "swap"
    prompts = random_prompts(args.concurrency, args.prompt_len, args.prompt_len,
                             vocab=llm.engine.vocab_size, seed=2)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    stats, scheduled = llm.engine.stats(), llm.engine.profiler.num_tokens
    llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"output_tokens_per_s": tokens / seconds, "seconds": seconds,
            "preemptions": stats.num_preemptions, "resumptions": stats.resumptions_by_method,
            "swapped_out_blocks": stats.swapped_out_blocks,
            "swapped_in_blocks": stats.host_tier_hits + stats.disk_tier_hits,
            # the tokens computed by prefills, first prompts and resumptions alike: every
            # token scheduled but those of decode steps (one a token sampled, bar the first)
            "prefilled_tokens": scheduled - tokens + len(prompts),
            "cost_ms_per_token": {way: 1000 * cost for way, cost
                                  in stats.resumption_cost_per_token.items()}}


def _host_name(info: dict[str, Any]) -> str:
    name = info.get("gpu") or info.get("cpu_model") or info.get("device") or "host"
    return re.sub(r"[^a-z0-9]+", "-", str(name).lower()).strip("-")[:40]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model directory (default: the random "
                    "~30M benchmark Llama)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", help="the engine's dtype (auto: float32 on a "
                    "CPU, bfloat16 on a GPU)")
    ap.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                    help="weight-only quantization of the decoder's linears")
    ap.add_argument("--kv-cache-blocks", type=int, default=64, help="device blocks (16 tokens)")
    ap.add_argument("--host-blocks", type=int, default=512, help="host tier blocks")
    ap.add_argument("--disk-blocks", type=int, default=2048, help="disk tier blocks")
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-len", type=int, default=96, help="user tokens a turn")
    ap.add_argument("--reply-len", type=int, default=32)
    ap.add_argument("--preempt-kv-cache-blocks", type=int, default=64,
                    help="device blocks (16 tokens) of the preemption workload")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=448)
    ap.add_argument("--skip", choices=("chat", "preemption"), default=None,
                    help="leave one workload out")
    ap.add_argument("--name", default=None, help="the result file's name (default: "
                    "kv_tier-<host>)")
    args = ap.parse_args(argv)
    info = machine()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(bench_model_dir(Path(tmp) / "model"))
        block = _block_bytes(model, args)
        host = args.host_blocks * block
        disk = dict(kv_offload_size=max(1, args.host_blocks // 32) * block,
                    kv_offload_path=str(Path(tmp) / "kv"),
                    kv_offload_disk_size=args.disk_blocks * (block + 32))
        chats = {} if args.skip == "chat" else {
            "no_tier": chat(model, args), "host": chat(model, args, kv_offload_size=host),
            "host_and_disk": chat(model, args, **disk)}
        preempt = {} if args.skip == "preemption" else {
            m: preemption(model, args, m) for m in ("swap", "recompute", "measured")}
    result: dict[str, Any] = {"settings": vars(args), "chat": chats, "preemption": preempt}
    for name, run in chats.items():
        print(f"chat {name:14s} returning-turn TTFT p50 {run['returning_ttft_p50_ms']:8.1f} ms  "
              f"p90 {run['returning_ttft_p90_ms']:8.1f} ms  (host hits {run['host_tier_hits']}, "
              f"disk hits {run['disk_tier_hits']})")
    for name, run in preempt.items():
        print(f"preemption {name:10s} {run['output_tokens_per_s']:8.1f} output tok/s  "
              f"({run['preemptions']} preemptions, resumptions {run['resumptions']}, "
              f"{run['swapped_in_blocks']} blocks swapped in, {run['prefilled_tokens']} "
              f"tokens prefilled; measured ms/token {run['cost_ms_per_token']})")
    if chats:
        ratio = (chats["host"]["returning_ttft_p50_ms"] or 0) / (
            chats["no_tier"]["returning_ttft_p50_ms"] or float("inf"))
        result["returning_ttft_p50_host_over_no_tier"] = ratio
        print(f"returning-turn TTFT p50, host tier / none: {ratio:.2f}x (target: <= 0.5x)")
    if preempt:
        tok_s = {m: run["output_tokens_per_s"] for m, run in preempt.items()}
        result["swap_over_recompute_tok_s"] = tok_s["swap"] / tok_s["recompute"]
        result["measured_over_recompute_tok_s"] = tok_s["measured"] / tok_s["recompute"]
        print(f"preemption output tok/s, swap / recompute: "
              f"{result['swap_over_recompute_tok_s']:.2f}x (target: >= 1.2x); measured / "
              f"recompute: {result['measured_over_recompute_tok_s']:.2f}x")
    print(write_result(args.name or f"kv_tier-{_host_name(info)}", result))


if __name__ == "__main__":
    main()
