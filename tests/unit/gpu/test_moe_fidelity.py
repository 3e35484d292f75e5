"""Mixture-of-experts models (Qwen3-MoE, Mixtral) give HF transformers' greedy tokens and
logprobs on the same random weights: in batches of several requests under chunked prefill, and
int8-quantized against HF running the same quantized weights dequantized."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.device import TEST_DEVICE
from tests.hf_reference import check_against_hf, fidelity_llm, reference_prompts
from tests.unit.gpu.test_quantized_fidelity import hf_twin
from tidal.gpu.moe import MoE
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
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(TEST_DEVICE)
    hf.generation_config.eos_token_id = None  # run on past EOS, as ignore_eos does
    hf.reference_cache = {}
    return hf


@pytest.mark.parametrize("name", ["qwen3_moe-unnormalised", "mixtral"])
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


def test_int8_matches_hf_on_the_dequantized_weights(tmp_path_factory):
    """Attention and the dense layer's MLP int8, the router and experts kept in float32 (HF's
    twin has the same: its experts are no ``nn.Linear``)."""
    path = _model_dir("qwen3_moe", tmp_path_factory)
    llm = fidelity_llm(path, quantization="int8")
    moe = [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, MoE)]
    assert moe and moe[0].experts.gate_up_proj.dtype == torch.float32
    check_against_hf(hf_twin(path, "int8"), llm, PROMPTS, tol=2e-4)
