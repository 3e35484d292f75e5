"""Tensor parallelism of MoE models over gloo on the CPU: two worker processes, each holding a
slice of every expert's intermediate, give one process's (HF's) greedy tokens and logprobs on
random Qwen3-MoE, Mixtral and gpt-oss (its expert biases and attention sinks split too); and
the experts' shards put back together are the whole weights, in both checkpoint forms."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.hf_reference import check_against_hf, reference_prompts
from tests.unit.gpu.test_gpt_oss_fidelity import hf_model
from tests.unit.gpu.test_moe_fidelity import _hf, _hf_twin_with_experts
from tests.unit.gpu.test_mxfp4 import _write_mxfp4_twins, pack, random_codes
from tests.unit.gpu.test_tensor_parallel import _config
from tidal.core import LLM
from tidal.gpu.checkpoints.mxfp4 import MXFP4_CODEBOOK, codebook_weight
from tidal.gpu.distributed import TensorParallel
from tidal.gpu.quantization.weights import quantize_int8
from tidal.gpu.random_model import build_model_dir
from tidal.gpu.weight_shards import shard_weight


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_two_ranks_match_one(tmp_path_factory, arch):
    """One engine start an architecture: two ranks against HF in one process (which one
    process of ours matches, test_moe_fidelity.py). Qwen3-MoE renormalised with a dense layer
    beside its MoE one; Mixtral int8, its experts' shards quantized weights cut at their
    inputs (HF's twin on the same weights dequantized)."""
    path = str(build_model_dir(tmp_path_factory.mktemp(arch), arch))
    quantization = "int8" if arch == "mixtral" else None
    hf = (_hf_twin_with_experts(path, "int8") if quantization else _hf(path)).to("cpu")
    llm = LLM(path, dtype="float32", max_model_len=512, tensor_parallel_size=2,
              quantization=quantization)
    try:
        check_against_hf(hf, llm, reference_prompts(5)[:2], tol=2e-4 if quantization else 1e-4)
    finally:
        llm.shutdown()


def test_expert_shards_put_back_together_are_the_experts():
    """Each rank: its slice of every expert's gate and up rows (gate half, then up half, as
    the block holds them) and down inputs; the down bias on rank 0 alone; a quantized expert's
    down cut at its inputs; the sinks by heads; the router whole."""
    cfg = replace(_config(), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    g = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    gate_up_bias, down_bias = torch.randn(e, 2 * i, generator=g), torch.randn(e, h, generator=g)
    ranks = [TensorParallel(r, 2) for r in range(2)]
    name = "model.layers.0.mlp.experts.{}"

    def shards(part: str, value):
        return [shard_weight(name.format(part), value, cfg, t) for t in ranks]

    halves = [torch.cat([p.chunk(2, dim=1)[k] for p in shards("gate_up_proj", gate_up)], dim=1)
              for k in range(2)]
    assert torch.equal(torch.cat(halves, dim=1), gate_up)
    bias_halves = [torch.cat([p.chunk(2, dim=1)[k] for p in shards("gate_up_proj_bias",
                                                                    gate_up_bias)], dim=1)
                   for k in range(2)]
    assert torch.equal(torch.cat(bias_halves, dim=1), gate_up_bias)
    assert torch.equal(torch.cat(shards("down_proj", down), dim=2), down)
    first, second = shards("down_proj_bias", down_bias)
    assert torch.equal(first, down_bias) and not second.any()
    sinks = torch.randn(cfg.num_heads, generator=g)
    assert torch.equal(torch.cat([shard_weight("model.layers.0.self_attn.sinks", sinks, cfg, t)
                                  for t in ranks]), sinks)
    router = torch.randn(e, h, generator=g)
    assert shard_weight("model.layers.0.mlp.gate.weight", router, cfg, ranks[1]) is router

    w2 = quantize_int8(torch.randn(h, i, generator=g))  # Mixtral's names, quantized
    parts = [shard_weight("model.layers.0.block_sparse_moe.experts.3.w2.weight", w2, cfg, t)
             for t in ranks]
    assert torch.equal(torch.cat([p.dequantize() for p in parts], dim=1), w2.dequantize())
    w1 = torch.randn(i, h, generator=g)
    assert torch.equal(torch.cat([shard_weight("model.layers.0.block_sparse_moe.experts.3.w1"
                                               ".weight", w1, cfg, t) for t in ranks]), w1)


@pytest.mark.slow
def test_two_ranks_keep_mxfp4_experts_and_match_hf(tmp_path):
    """gpt-oss's MXFP4 experts cut at their blocks (64 intermediates: a block of 32 a rank),
    each rank's slice kept as codes and exponents: two ranks against HF on the float twin,
    on the exact path (the kernels off: each slice the int8 weight it equals)."""
    float_dir = build_model_dir(tmp_path / "float", "gpt_oss", num_hidden_layers=2,
                                intermediate_size=64)
    _write_mxfp4_twins(float_dir, tmp_path / "mxfp4")
    llm = LLM(str(tmp_path / "mxfp4"), dtype="float32", max_model_len=512,
              tensor_parallel_size=2, cpu_kernels="off")
    try:
        check_against_hf(hf_model(str(float_dir)), llm, reference_prompts(1)[2:4])
    finally:
        llm.shutdown()


def test_mxfp4_expert_shards_put_back_together_are_the_expert():
    """An MXFP4 expert's gate and up rows split by rows, its down by whole blocks of inputs,
    every shard still codes over the codebook (not expanded to int8)."""
    cfg = replace(_config(), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    codebook = torch.tensor(MXFP4_CODEBOOK, dtype=torch.int8)
    ranks = [TensorParallel(r, 2) for r in range(2)]
    for part, (rows, cols), dim in (("gate_proj", (i, h), 0), ("down_proj", (h, i), 1)):
        nibbles, scales = random_codes((rows, cols // 32), seed=rows, scale_range=(120, 128))
        whole = codebook_weight(pack(nibbles), scales, codebook)
        shards = [shard_weight(f"model.layers.0.mlp.experts.1.{part}.weight", whole, cfg, t)
                  for t in ranks]
        assert all(s.codebook is not None and s.bits == 4 for s in shards)
        assert torch.equal(torch.cat([s.dequantize() for s in shards], dim=dim),
                           whole.dequantize())
