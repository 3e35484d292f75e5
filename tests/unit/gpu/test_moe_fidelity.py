"""Mixture-of-experts models (Qwen3-MoE, Mixtral) give HF transformers' greedy tokens and
logprobs on the same random weights: in batches of several requests under chunked prefill, and
int8- and int4-quantized (the experts too) against HF running the same quantized weights
dequantized."""

from __future__ import annotations

import pytest
import torch

from tests.hf_reference import check_against_hf, fidelity_llm, hf_float_model, reference_prompts
from tests.marks import quick_only
from tests.unit.gpu.test_quantized_fidelity import FORMATS, hf_twin
from tidal.gpu.moe import MoE
from tidal.gpu.quantization.linear import QuantLinear
from tidal.gpu.quantization.weights import quantize
from tidal.gpu.random_model import build_model_dir

pytestmark = pytest.mark.gpu

# 8 experts, top 2 (gpu/random_model.py); Qwen3-MoE with one dense layer, renormalised or not
MODELS = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe-unnormalised": ("qwen3_moe", {"norm_topk_prob": False, "mlp_only_layers": [0]}),
    "mixtral": ("mixtral", {}),
}
PROMPTS = reference_prompts(0)[::3]  # 1, 33 and 150 tokens
_BUILT: dict[str, str] = {}


def _model_dir(name: str, tmp_path_factory) -> str:
    if name not in _BUILT:
        arch, overrides = MODELS[name]
        _BUILT[name] = str(build_model_dir(tmp_path_factory.mktemp(name), arch, **overrides))
    return _BUILT[name]


def _hf(path: str):
    return hf_float_model(path)


@pytest.mark.parametrize("name", quick_only(["qwen3_moe-unnormalised", "mixtral"],
                                            "qwen3_moe-unnormalised"))
def test_matches_hf_in_chunked_batches(name, tmp_path_factory):
    """Prefill chunks of 24 tokens beside other requests' decode rows, three requests at a
    time: steps of one token up to full chunks route through the experts. (Renormalised
    Qwen3-MoE routing is held to HF by the int8 test below and test_moe.py's block test.)"""
    path = _model_dir(name, tmp_path_factory)
    llm = fidelity_llm(path, max_num_batched_tokens=24, max_num_seqs=3)
    runner = llm.engine.executor.runner
    moe = [m for m in runner.model.modules() if isinstance(m, MoE)]
    assert len(moe) == (2 if name == "mixtral" else 1)
    assert runner.cuda_graphs is None and (runner.cpu is None or runner.cpu.stack is None)
    check_against_hf(_hf(path), llm, PROMPTS)


@pytest.mark.parametrize("name, fmt", [("qwen3_moe", "int8"), ("mixtral", "int4g32")])
def test_quantized_matches_hf_on_the_dequantized_weights(name, fmt, tmp_path_factory):
    """Attention, the dense layer's MLP and every expert quantized (the router kept in
    float32): HF's twin runs the same weights dequantized, its experts' too."""
    path = _model_dir(name, tmp_path_factory)
    method, group = FORMATS[fmt]
    llm = fidelity_llm(path, quantization=method, quantization_group_size=group)
    moe = [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, MoE)]
    assert moe and all(m.quantized for m in moe)
    assert not any(isinstance(m.gate, QuantLinear) for m in moe)
    check_against_hf(_hf_twin_with_experts(path, fmt), llm, PROMPTS, tol=2e-4)


@torch.no_grad()
def _hf_twin_with_experts(path: str, fmt: str):
    """``hf_twin``, its experts' stacked matrices (no ``nn.Linear``) quantized expert by expert
    and dequantized too."""
    method, group = FORMATS[fmt]
    hf = hf_twin(path, fmt)
    for layer in hf.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        for stacked in ((experts.gate_up_proj, experts.down_proj) if experts else ()):
            for matrix in stacked:
                matrix.copy_(quantize(matrix.cpu(), method, group).dequantize().to(matrix))
    return hf
