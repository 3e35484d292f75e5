"""Timing pieces of the decode benchmarks: copy bandwidth, the model's decode forward alone
(CUDA graph replay where the runner has graphs), and whole engine decode steps."""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path

import torch

from bench.common import machine, random_prompts
from tidal.core import LLM, SamplingParams
from tidal.gpu.attention import AttentionMetadata
from tidal.gpu.model_runner import ModelRunner


def add_decode_args(ap: argparse.ArgumentParser) -> None:
    """Flags every decode benchmark shares (sizes left at None take the tiny or full
    defaults in ``apply_defaults``)."""
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--model-root", default=str(Path(tempfile.gettempdir()) / "tidal-shapes"))


def apply_defaults(args: argparse.Namespace, tiny: dict, full: dict) -> argparse.Namespace:
    """Fill the size flags left unset from ``tiny`` (with ``--tiny``) or ``full``."""
    for name, value in (tiny if args.tiny else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def device_slug(device: str) -> str:
    """``nvidia-h100-80gb-hbm3`` for a GPU, ``cpu`` for the CPU: the results file suffix."""
    if not device.startswith("cuda"):
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", machine()["device"].lower()).strip("-")


def copy_bandwidth(device: str, nbytes: int | None = None, iters: int = 10) -> float:
    """Bytes per second a device-to-device copy moves (each byte read once, written once)."""
    nbytes = nbytes or ((1 << 30) if device.startswith("cuda") else (64 << 20))
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * iters / (time.perf_counter() - start)


def decode_inputs(runner: ModelRunner, batch: int,
                  context: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A decode step of ``batch`` requests at position ``context``, each over its own blocks
    from block 0 up (it overwrites them: run it with no request alive)."""
    bs, dev = runner.block_size, runner.device
    per_req = -(-(context + 1) // bs)
    num_blocks = runner.kv_caches[0][0].shape[0]
    if batch * per_req > num_blocks:
        raise ValueError(f"{batch} requests of {context + 1} tokens need {batch * per_req} "
                         f"KV blocks; the cache has {num_blocks}")
    table = torch.arange(batch * per_req, dtype=torch.int32, device=dev).view(batch, per_req)
    slots = table[:, context // bs].long() * bs + context % bs
    meta = AttentionMetadata(
        num_actual_tokens=batch,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.full((batch,), context + 1, dtype=torch.int32, device=dev),
        block_table=table, slot_mapping=slots, max_query_len=1, max_seq_len=context + 1,
        query_start_loc_cpu=list(range(batch + 1)), seq_lens_cpu=[context + 1] * batch)
    ids = torch.randint(10, runner.vocab_size, (batch,), device=dev)
    positions = torch.full((batch,), context, dtype=torch.long, device=dev)
    return ids, positions, meta


@torch.inference_mode()
def time_decode_forward(runner: ModelRunner, batch: int, context: int, iters: int = 20,
                        warmup: int = 3) -> float:
    """Milliseconds of one decode step's device work: forward (graph replay where captured),
    logits and argmax, launched back to back with no engine in between."""
    ids, positions, meta = decode_inputs(runner, batch, context)
    graphs = runner.cuda_graphs

    def step() -> None:
        if graphs is not None and graphs.can_run(meta):
            hidden = graphs.run(ids, positions, meta)
        else:
            hidden = runner.run_model(ids, positions, meta)  # the CPU's one-call step first
        runner.model.compute_logits(hidden).float().argmax(-1)

    for _ in range(warmup):
        step()
    sync(runner.device)
    start = time.perf_counter()
    for _ in range(iters):
        step()
    sync(runner.device)
    return 1000 * (time.perf_counter() - start) / iters


def time_engine_decode(llm: LLM, batch: int, prompt_len: int, steps: int,
                       warmup: int) -> dict:
    """Milliseconds per engine step while ``batch`` requests decode (prefill excluded), and
    the profiler's phases. The requests are aborted afterwards."""
    engine = llm.engine
    vocab = min(len(llm.tokenizer), engine.vocab_size)
    prompts = random_prompts(batch, prompt_len, prompt_len, vocab=vocab, seed=batch)
    params = SamplingParams(temperature=0.0, max_tokens=warmup + steps + 8, ignore_eos=True)
    ids = [f"decode-{batch}-{i}" for i in range(batch)]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    started: set[str] = set()
    while len(started) < batch:  # prefill until every request has its first token
        started.update(o.request_id for o in engine.step())
    for _ in range(warmup):
        engine.step()
    sync(llm.engine.config.device)
    engine.profiler.reset()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(llm.engine.config.device)
    elapsed = time.perf_counter() - start
    phases = engine.profiler.breakdown()
    engine.abort_requests(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return {"step_ms": 1000 * elapsed / steps, "phases_ms": phases}
