"""gpt-oss gives HF transformers' greedy tokens and logprobs on the same random weights
(``gpu/random_model.py``: sliding layers of window 8 beside a full one, attention sinks, q/k/v/o
biases, 4 experts with biases and a clamped SwiGLU, a router with a bias, YaRN): prompts longer
than the window, in batches of several requests under chunked prefill."""

from __future__ import annotations

import pytest

from tests.hf_reference import check_against_hf, fidelity_llm, hf_float_model, reference_prompts
from tidal.gpu.models.gpt_oss import GptOssForCausalLM
from tidal.gpu.moe import MoE
from tidal.gpu.random_model import build_model_dir

pytestmark = pytest.mark.gpu

PROMPTS = reference_prompts(0)[::3]  # 1, 33 and 150 tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_model_dir(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss"))


def hf_model(path: str):
    return hf_float_model(path)


def test_matches_hf_in_chunked_batches(model_dir):
    """Prefill chunks of 24 tokens beside other requests' decode rows, three requests at a
    time, over prompts of up to 150 tokens (the window is 8)."""
    llm = fidelity_llm(model_dir, max_num_batched_tokens=24, max_num_seqs=3)
    runner = llm.engine.executor.runner
    model = runner.model
    assert isinstance(model, GptOssForCausalLM)
    assert [layer.self_attn.window for layer in model.layers] == [8, 0, 8]
    assert all(layer.self_attn.sinks is not None for layer in model.layers)
    assert sum(isinstance(m, MoE) for m in model.modules()) == 3
    assert runner.cuda_graphs is None and (runner.cpu is None or runner.cpu.stack is None)
    check_against_hf(hf_model(model_dir), llm, PROMPTS)
