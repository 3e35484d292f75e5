"""The offline benchmark's floor: its count of a run's work against what the engine computes,
and its report's arithmetic. No timing is asserted."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bench import offline_floor
from bench.offline_floor import HostRates, OfflineWork, floor_report
from tidal.core import LLM, SamplingParams
from tidal.gpu.cpu.packed_linear import PackedLinear
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.random_model import build_model_dir

PROMPTS = [[7, 8, 9, 10, 11], [40, 41, 42], list(range(20, 37))]
OUTPUT_LEN = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("floor") / "llama", "llama")


def _linear_macs_of_a_run(model_dir) -> int:
    """Multiply-adds that the engine's linear layers did while generating for ``PROMPTS``,
    counted from the rows each one was given (the Python path, whose layers are modules)."""
    llm = LLM(str(model_dir), max_num_seqs=2)
    runner = llm.engine.executor.runner
    model = runner.model
    runner.cpu.stack = None  # the Python path, whose layers are modules
    macs = 0

    def count(module: nn.Module, args: tuple, _out: torch.Tensor) -> None:
        nonlocal macs
        macs += args[0].numel() * module.out_features  # rows x in x out

    for module in model.modules():
        if isinstance(module, (nn.Linear, PackedLinear)):
            module.register_forward_hook(count)
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    llm.generate(PROMPTS, params, use_tqdm=False)
    return macs


def test_matmul_flops_are_what_the_engine_computes(model_dir):
    work = OfflineWork.of(ModelConfig.from_dir(model_dir), [len(p) for p in PROMPTS],
                          OUTPUT_LEN, dtype_size=4)
    assert work.matmul_flop == 2 * _linear_macs_of_a_run(model_dir)


def test_kv_reads_are_every_decode_steps_context(model_dir):
    config = ModelConfig.from_dir(model_dir)
    work = OfflineWork.of(config, [len(p) for p in PROMPTS], OUTPUT_LEN, dtype_size=2)
    # after its prefill, a prompt's k-th generated token is fed back and attends over the
    # prompt and the k tokens generated so far
    positions = sum(len(p) + k for p in PROMPTS for k in range(1, OUTPUT_LEN))
    assert work.kv_read_bytes == positions * config.kv_bytes_per_token(2)


def test_floor_report_divides_the_work_by_the_rates():
    work = OfflineWork(matmul_flop=6e12, kv_read_bytes=40e9)
    rates = HostRates(matmul_flop_per_s=300e9, read_bytes_per_s=20e9)
    report = floor_report(work, rates, ours_seconds=33.0, peer_seconds=66.0)
    assert report["floor_seconds"] == pytest.approx(22.0)
    assert report["tidal_over_floor"] == pytest.approx(1.5)
    assert report["ratio_ceiling"] == pytest.approx(3.0)
    assert (report["matmul_tflop"], report["kv_read_gb"]) == pytest.approx((6.0, 40.0))


def test_host_rates_are_measured(monkeypatch):
    monkeypatch.setattr(offline_floor, "MATMUL_SIZE", 128)
    monkeypatch.setattr(offline_floor, "READ_BYTES", {"cpu": 1 << 20})
    rates = HostRates.measure("cpu", "float32", repeats=2)
    assert rates.matmul_flop_per_s > 1e6 and rates.read_bytes_per_s > 1e6
