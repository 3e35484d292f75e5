"""Shared bits of the benchmarks: the benchmark model, prompts, and writing results."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tidal.gpu.cpu.host import cpu_model, parse_cpuinfo, simd_flags
from tidal.gpu.random_model import build_model_dir

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# ~30M parameters: hidden 512, 8 layers, 8 heads / 4 KV heads, vocab 8192
BENCH_LLAMA = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
                   tie_word_embeddings=False)


def bench_model_dir(path: str | Path, vocab_size: int = 8192) -> Path:
    """The random ~30M-parameter Llama the benchmarks run on (built once, then reused)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        build_model_dir(path, "llama", seed=0, vocab_size=vocab_size, **BENCH_LLAMA)
    return path


def random_prompts(num: int, min_len: int, max_len: int, vocab: int,
                   seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(min_len, max_len))]
            for _ in range(num)]


def decode_timings(llm, batch: int, input_len: int, output_len: int,
                   passes: int = 2) -> tuple[float, float]:
    """Seconds for ``batch`` fresh prompts (no prefix-cache hits) to ``output_len`` tokens and
    to one token, each the best of ``passes``, after a warm-up; ``llm`` is shut down after.
    Their difference over ``output_len - 1`` is the decode step."""
    from tidal.core import SamplingParams

    seeds = itertools.count()

    def run(tokens: int) -> float:
        prompts = random_prompts(batch, input_len, input_len, 3000, seed=next(seeds))
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True,
                                detokenize=False)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    try:
        run(2)  # warm-up
        whole = min(run(output_len) for _ in range(passes))
        first = min(run(1) for _ in range(passes))
    finally:
        llm.shutdown()
    return whole, first


def add_head_args(ap: argparse.ArgumentParser, repeats: int) -> None:
    """The flags the attention benchmarks share: timed calls per layout and the heads' shape
    (default: the bench model's 8 query heads and 4 KV heads of 64)."""
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)


def time_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median of ``repeats`` timed calls after one warm-up call."""
    times = _call_times(fn, repeats)
    return 1000 * times[len(times) // 2]


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls after one warm-up call: what the host can reach,
    with the calls that another tenant slowed left out."""
    return 1000 * _call_times(fn, repeats)[0]


def _call_times(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds each of ``repeats`` calls took after one warm-up call, fastest first."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)


def cpu_info(cpuinfo: str | None = None) -> dict:
    """The CPU's model name and SIMD flags (``gpu.cpu.host``), from ``cpuinfo``'s text where
    given, else this machine's."""
    model, flags = parse_cpuinfo(cpuinfo) if cpuinfo is not None else (cpu_model(), None)
    return {"cpu_model": model, "cpu_flags": simd_flags(flags)}


def git_commit() -> str | None:
    """The checkout's commit, ``+dirty`` when tracked files differ from it; None outside git."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def machine() -> dict:
    """The host a benchmark ran on, stored with every result (``write_result``): CPU model,
    its SIMD flags and core count, the GPU if any, torch and the git commit."""
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "cpu_threads": torch.get_num_threads(),
            **cpu_info(), "cpu_cores": os.cpu_count(), "gpu": None,
            "git_commit": git_commit()}
    if torch.cuda.is_available():
        info["gpu"] = info["device"] = torch.cuda.get_device_name()
    else:
        info["device"] = f"cpu ({platform.processor() or platform.machine()})"
    return info


def host_line(info: dict) -> str:
    """``machine()`` in one line, for the Markdown beside a result."""
    if not info:
        return "unknown host"
    flags = ", ".join(info.get("cpu_flags") or []) or "no SIMD flags known"
    commit = info.get("git_commit") or "unknown"
    return (f"{info.get('cpu_model') or info.get('device')}, {info.get('cpu_cores', '?')} "
            f"cores ({flags}); GPU: {info.get('gpu') or 'none'}; torch {info.get('torch')}; "
            f"tidal commit {commit[:12] + commit[40:]}")


def write_result(name: str, result: dict) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": name, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "machine": machine(), **result}
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
