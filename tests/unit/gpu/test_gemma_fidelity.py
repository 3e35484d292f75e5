"""Gemma 2 and Gemma 3 (text): our greedy tokens and logprobs equal HF transformers' on the same
random weights, with sliding windows of 8 shorter than the prompts (so windowing runs in prefill,
chunked prefill and decode), Gemma 2's soft-capping on, and Gemma 3's q/k norms and local
rotary base; on the CPU kernels (the tests' default) and the torch attention path."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from tests.hf_reference import check_against_hf, fidelity_llm, hf_float_model, reference_prompts
from tests.marks import quick_only
from tidal.gpu.models.gemma import GemmaForCausalLM
from tidal.gpu.random_model import build_model_dir

pytestmark = pytest.mark.gpu

# prompts of 5, 17, 33 and 100 tokens: one inside the window, the rest across it
PROMPTS = [reference_prompts(0)[i] for i in (1, 2, 3, 5)]
_BUILT: dict[str, tuple[str, AutoModelForCausalLM]] = {}


def _model(arch: str, tmp_path_factory) -> tuple[str, AutoModelForCausalLM]:
    """A model directory and its HF twin (eager attention: HF soft-caps only there), built
    once per test session."""
    if arch not in _BUILT:
        path = build_model_dir(tmp_path_factory.mktemp(arch), arch)
        hf = hf_float_model(str(path), attn_implementation="eager")
        hf.generation_config.cache_implementation = "dynamic"
        _BUILT[arch] = (str(path), hf)
    return _BUILT[arch]


@pytest.fixture(params=["gemma2", "gemma3"])
def gemma(request, tmp_path_factory):
    return _model(request.param, tmp_path_factory)


@pytest.mark.parametrize("attention", quick_only(["auto", "torch"], "auto"))
def test_matches_hf(gemma, attention):
    path, hf = gemma
    llm = fidelity_llm(path, attention_backend=attention)
    assert isinstance(llm.engine.executor.runner.model, GemmaForCausalLM)
    check_against_hf(hf, llm, PROMPTS)


def test_matches_hf_under_chunked_prefill(gemma):
    path, hf = gemma
    check_against_hf(hf, fidelity_llm(path, max_num_batched_tokens=24), PROMPTS)
