"""Our greedy tokens and logprobs equal HF transformers' on the same weights, whatever the
batching, chunking, prefix caching or preemption."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from tests.hf_reference import check_against_hf, fidelity_llm, hf_float_model, reference_prompts
from tests.marks import quick_only
from tidal.core import SamplingParams
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.random_model import build_model_dir

pytestmark = pytest.mark.gpu

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
MODELS = {
    "llama": ("llama", {}),
    "llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE}),
    "mistral": ("mistral", {"tie_word_embeddings": True}),
    "qwen2": ("qwen2", {"hidden_size": 128}),  # head_dim 32: decode steps in one C++ call
    "qwen3": ("qwen3", {}),
}


def _twenty_blocks(path: str) -> int:
    """KV-cache bytes for 20 blocks of 16 float32 tokens of this model."""
    return 20 * 16 * ModelConfig.from_dir(path).kv_bytes_per_token(4)


_BUILT: dict[str, tuple[str, AutoModelForCausalLM]] = {}


def _model(name: str, tmp_path_factory) -> tuple[str, AutoModelForCausalLM]:
    """A model directory and its HF twin, built once per test session."""
    if name not in _BUILT:
        arch, overrides = MODELS[name]
        path = build_model_dir(tmp_path_factory.mktemp(name), arch, **overrides)
        hf = hf_float_model(str(path))
        _BUILT[name] = (str(path), hf)
    return _BUILT[name]


@pytest.fixture(params=quick_only(MODELS, "llama", "qwen3"))
def model(request, tmp_path_factory):
    return _model(request.param, tmp_path_factory)


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def core_model(request, tmp_path_factory):
    """The architectures the slower conditions run on."""
    return _model(request.param, tmp_path_factory)


def test_matches_hf_in_one_batch(model):
    path, hf = model
    check_against_hf(hf, fidelity_llm(path), reference_prompts(0))


def test_matches_hf_with_prefix_cache_hits(model):
    path, hf = model
    llm = fidelity_llm(path, enable_prefix_caching=True)
    prompts = reference_prompts(1, shared_prefix=40)
    llm.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)  # warm the cache
    check_against_hf(hf, llm, prompts)
    assert llm.engine.stats().prefix_cache_hits >= len(prompts) * 32


@pytest.mark.slow
def test_matches_hf_under_chunked_prefill(core_model):
    path, hf = core_model
    check_against_hf(hf, fidelity_llm(path, max_num_batched_tokens=24), reference_prompts(0))


@pytest.mark.slow
def test_matches_hf_under_preemption(core_model):
    path, hf = core_model
    llm = fidelity_llm(path, kv_cache_memory=_twenty_blocks(path))
    assert llm.engine.kv.num_blocks == 20
    check_against_hf(hf, llm, reference_prompts(0))
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.kv.pool.num_free_blocks == 20


@pytest.mark.slow
def test_matches_hf_with_two_seqs_at_a_time(core_model):
    path, hf = core_model
    check_against_hf(hf, fidelity_llm(path, max_num_seqs=2), reference_prompts(0))


@pytest.mark.slow
def test_matches_hf_with_async_scheduling_under_preemption_and_chunking(core_model):
    path, hf = core_model
    llm = fidelity_llm(path, async_scheduling=True, max_num_batched_tokens=48,
               kv_cache_memory=_twenty_blocks(path))
    check_against_hf(hf, llm, reference_prompts(0))
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.kv.pool.num_free_blocks == 20


def test_async_scheduling_survives_aborts_and_frees_blocks(tmp_path_factory):
    path, _ = _model("llama", tmp_path_factory)
    prompts = reference_prompts(5)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    sync_out = fidelity_llm(path, async_scheduling=False).generate(prompts, params, use_tqdm=False)
    llm = fidelity_llm(path, async_scheduling=True, max_num_seqs=4)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    results: dict[str, list[int]] = {}
    for step in range(1000):
        if step == 6:
            engine.abort_requests(["1", "6"])
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if out.request_id in ("1", "6"):
                assert out.outputs[0].finish_reason in (None, "abort")
        if not engine.has_unfinished_requests():
            break
    for i, expected in enumerate(sync_out):
        if str(i) not in ("1", "6"):
            assert results[str(i)] == expected.outputs[0].token_ids
    assert engine.kv.pool.num_free_blocks == engine.kv.num_blocks
    assert not engine.executor.runner.batch.states
