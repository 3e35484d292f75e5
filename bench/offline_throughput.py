"""Offline throughput: the same prompts through ``LLM.generate`` and through HF ``generate``.

HF runs padded static batches (left padding); both produce exactly ``--output-len`` tokens per
prompt (EOS ignored), in the same ``--dtype`` on the same ``--device``, and both give token ids
only: HF ``generate`` makes no text, so tidal runs with ``detokenize=False`` unless
``--detokenize`` asks for its text too (vLLM's throughput benchmark has the same switch). Each
side runs in a fresh process of its own, so neither inherits the other's allocator state,
thread pools or warm caches. Prints and writes ``bench/results/offline_throughput.json`` (the
name gains ``-<device>``, ``-<model dir name>``, ``-<shape>`` and ``-<dtype>`` where those are
not the defaults; ``--name`` sets it). With them goes the work's floor on this host
(``bench/offline_floor.py``): its matmul FLOPs and KV-cache reads at the rates torch's own
matmul and sum reach here, and so the most any engine could gain on HF's time.

    python -m bench.offline_throughput            # 256 prompts of 64-256 tokens, 128 out
    python -m bench.offline_throughput --model core/default_model --min-len 32 --max-len 120 \
        --max-num-seqs 64
    python -m bench.offline_throughput --device cuda --shape qwen2.5-0.5b --dtype bfloat16 \
        --num-prompts 512 --max-num-seqs 256 --hf-batch-size 128
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TypeVar

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench.common import bench_model_dir, random_prompts, write_result
from bench.model_shapes import SHAPES, build_shaped_model_dir
from bench.offline_floor import HostRates, OfflineWork, floor_report
from tidal.core import LLM, SamplingParams
from tidal.gpu.model_config import ModelConfig

T = TypeVar("T")
PROMPT_VOCAB = 8000  # prompt ids are drawn below this, or below a smaller model's vocabulary


def run_ours(model: str, prompts: list[list[int]], warm: list[list[int]], output_len: int,
             max_num_seqs: int, max_num_batched_tokens: int | None, dtype: str,
             device: str, detokenize: bool) -> dict:
    llm = LLM(model, dtype=dtype, device=device, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=max_num_batched_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            detokenize=detokenize)
    llm.generate(warm, params, use_tqdm=False)  # other prompts: no prefix-cache hits later
    llm.engine.profiler.reset()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    prof = llm.engine.profiler
    return {"seconds": elapsed, "output_tokens": tokens, "output_tok_per_s": tokens / elapsed,
            "max_num_batched_tokens": llm.engine.config.max_num_batched_tokens,
            "steps": prof.num_steps, "step_ms": prof.breakdown(),
            "overhead_share": prof.overhead_share()}


@torch.inference_mode()
def run_hf(model: str, prompts: list[list[int]], warm: list[list[int]], output_len: int,
           batch_size: int, dtype: str, device: str) -> dict:
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0

    def batch_generate(batch: list[list[int]]) -> int:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch],
                            device=device)
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                          do_sample=False)
        return (out.shape[1] - width) * len(batch)  # the shape: no device sync

    batch_generate(warm)
    start = time.perf_counter()
    tokens = sum(batch_generate(prompts[i:i + batch_size])
                 for i in range(0, len(prompts), batch_size))
    if device != "cpu":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": tokens, "output_tok_per_s": tokens / elapsed,
            "batch_size": batch_size}


def in_fresh_process(fn: Callable[..., T], *args: object) -> T:
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        return pool.submit(fn, *args).result()


def _model_dir(shape: str | None) -> str:
    root = tempfile.gettempdir()
    if shape is None:
        return str(bench_model_dir(root + "/tidal-bench-llama"))
    return str(build_shaped_model_dir(f"{root}/tidal-shapes/{shape}", shape))


def _floor(model: str, prompts: list[list[int]], args: argparse.Namespace, ours: dict,
           hf: dict) -> dict:
    """The run's work at the rates torch reaches on this host (``bench/offline_floor.py``)."""
    dtype_size = getattr(torch, args.dtype).itemsize
    work = OfflineWork.of(ModelConfig.load(model), [len(p) for p in prompts],
                          args.output_len, dtype_size)
    rates = in_fresh_process(HostRates.measure, args.device, args.dtype)
    return floor_report(work, rates, ours["seconds"], hf["seconds"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="HF model dir (default: a random ~30M Llama)")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    # each side at its best batch on the 2-core CPU: tidal 128 (1,315 tok/s; 64: 1,136;
    # 256: 1,228), HF 64 (623 tok/s; 32: 556; 16: 491; 128: 410), float32. The embedded
    # model, whose KV cache is larger for its size, wants 64: tidal 6,353 (32: 6,103; 48:
    # 6,255; 96: 6,081; 128: 5,846; 256: 5,896), HF 64 (1,880; 32: 1,825; 128: 1,502)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int,
                    help="tidal's token budget (default: LLM's for the device)")
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="weights and activations on both sides")
    ap.add_argument("--device", default="cpu", help="cpu or cuda, for both sides")
    ap.add_argument("--detokenize", action="store_true",
                    help="tidal also makes the output text (HF generate makes none)")
    ap.add_argument("--shape", choices=list(SHAPES),
                    help="a random-weight model in this real model's shape (bfloat16 weights)")
    ap.add_argument("--no-floor", action="store_true",
                    help="leave out the floor (its rates are measured in a process of their own)")
    ap.add_argument("--name", help="results file name (default: offline_throughput and the "
                    "device, model, shape and dtype where those are not the defaults)")
    args = ap.parse_args()

    model = args.model or _model_dir(args.shape)
    vocab = min(PROMPT_VOCAB, AutoConfig.from_pretrained(model).vocab_size)
    prompts = random_prompts(args.num_prompts, args.min_len, args.max_len, vocab=vocab)
    warm = random_prompts(4, args.min_len, args.max_len, vocab=vocab, seed=1)
    ours = in_fresh_process(run_ours, model, prompts, warm, args.output_len, args.max_num_seqs,
                            args.max_num_batched_tokens, args.dtype, args.device,
                            args.detokenize)
    print(f"tidal: {ours['output_tok_per_s']:.1f} output tok/s, "
          f"overhead {100 * ours['overhead_share']:.1f}% of step time")
    hf = in_fresh_process(run_hf, model, prompts, warm, args.output_len, args.hf_batch_size,
                          args.dtype, args.device)
    print(f"HF generate: {hf['output_tok_per_s']:.1f} output tok/s")
    ratio = ours["output_tok_per_s"] / hf["output_tok_per_s"]
    print(f"ratio tidal / HF: {ratio:.2f}x")
    floor = None if args.no_floor else _floor(model, prompts, args, ours, hf)
    if floor is not None:
        print(f"the work: {floor['matmul_tflop']:.2f} TFLOP of matmuls and "
              f"{floor['kv_read_gb']:.0f} GB of KV reads, {floor['floor_seconds']:.1f} s at "
              f"torch's {floor['torch_matmul_gflop_per_s']:.0f} GFLOP/s and "
              f"{floor['torch_read_gb_per_s']:.1f} GB/s here: at most "
              f"{floor['ratio_ceiling']:.2f}x HF (tidal took {floor['tidal_over_floor']:.2f}x "
              "that)")
    parts = [args.device.split(":")[0] if args.device != "cpu" else None,
             Path(args.model).name if args.model else None, args.shape,
             None if args.dtype == "float32" else args.dtype]
    name = args.name or "-".join(["offline_throughput", *filter(None, parts)])
    path = write_result(name, {
        "workload": vars(args) | {"model": model}, "tidal": ours, "hf_generate": hf,
        "ratio_output_tok_per_s": ratio, "floor": floor})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
