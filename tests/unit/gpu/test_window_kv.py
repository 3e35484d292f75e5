"""Sliding-window layers hold only their window's KV blocks (core/kv_window.py): random Gemma 3
and gpt-oss models with a window of 32 and blocks of 16, prompts and replies well past the
window, give HF transformers' greedy tokens while each request's window blocks, counted from
the window pool, stay within the window's bound; prefix hits and preemption stay correct."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from tests.hf_reference import check_against_hf, fidelity_llm, hf_float_model, reference_prompts
from tidal.core.kv_cache_manager import KVCacheManager
from tidal.core.sampling_params import SamplingParams
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.random_model import build_model_dir

pytestmark = pytest.mark.gpu

WINDOW, BS, CHUNK = 32, 16, 24
PROMPTS = [reference_prompts(0)[i] for i in (3, 5, 6)]  # 33, 100 and 150 tokens, + 32 new
_BUILT: dict[str, tuple[str, AutoModelForCausalLM]] = {}


def _model(arch: str, tmp_path_factory) -> tuple[str, AutoModelForCausalLM]:
    if arch not in _BUILT:
        path = build_model_dir(tmp_path_factory.mktemp(arch), arch, sliding_window=WINDOW)
        hf = hf_float_model(str(path), attn_implementation="eager")
        hf.generation_config.cache_implementation = "dynamic"
        _BUILT[arch] = (str(path), hf)
    return _BUILT[arch]


def _watch_window_blocks(kv: KVCacheManager) -> dict[str, int]:
    """The most window blocks each request held after any allocation, from the pool's side."""
    most: dict[str, int] = {}
    allocate = kv.allocate_slots

    def watched(request, num_new_tokens, computed_blocks=None, num_computed_tokens=0):
        out = allocate(request, num_new_tokens, computed_blocks, num_computed_tokens)
        assert kv.window is not None
        table = kv.window.tables.get(request.request_id, [])
        held = sum(1 for b in table if b is not kv.window.null)
        # the step's first token reaches back to this block: it and every later one are held
        first = max(0, request.num_computed_tokens + num_computed_tokens - WINDOW + 1) // BS
        assert out is None or kv.window.null not in table[first:]
        most[request.request_id] = max(most.get(request.request_id, 0), held)
        return out

    kv.allocate_slots = watched  # type: ignore[method-assign]
    return most


@pytest.mark.parametrize("arch", ["gemma3", "gpt_oss"])
def test_window_layers_hold_only_their_window(arch, tmp_path_factory):
    path, hf = _model(arch, tmp_path_factory)
    llm = fidelity_llm(path, block_size=BS, max_num_batched_tokens=CHUNK, max_num_seqs=3)
    kv = llm.engine.kv
    assert kv.window is not None and kv.window.window == WINDOW
    runner = llm.engine.executor.runner
    windows = ModelConfig.load(path).layer_windows()
    assert [c[0].shape[0] for c in runner.kv_caches] == [
        kv.window.pool.num_blocks if w else kv.num_blocks for w in windows]
    most = _watch_window_blocks(kv)
    check_against_hf(hf, llm, PROMPTS)
    bound = -(-(WINDOW + CHUNK - 1) // BS) + 1  # the window and a chunk, one block over
    assert len(most) == len(PROMPTS) and max(most.values()) <= bound
    assert max(most.values()) < -(-(150 + 32) // BS)  # the longest history: far more
    assert kv.window.num_held() == 0 and kv.pool.num_free_blocks == kv.num_blocks


def test_window_blocks_under_prefix_hits_and_preemption(tmp_path_factory):
    """With async scheduling: a step is scheduled while the one before it runs."""
    path, hf = _model("gemma3", tmp_path_factory)
    cfg = ModelConfig.load(path)
    per_layer_block = BS * cfg.kv_bytes_per_token(4) // cfg.num_layers
    windows = cfg.layer_windows()
    num_window = sum(1 for w in windows if w)
    # twenty full blocks beside three requests' windows: three replies of up to 182 tokens
    # (twelve blocks each) preempt one another
    seats = 3 * (-(-(WINDOW + CHUNK - 1) // BS) + 1)
    memory = per_layer_block * (20 * (len(windows) - num_window) + (seats + 1) * num_window)
    llm = fidelity_llm(path, block_size=BS, max_num_batched_tokens=CHUNK, max_num_seqs=3,
                       kv_cache_memory=memory, async_scheduling=True)
    kv = llm.engine.kv
    assert kv.num_blocks == 20 and kv.window is not None
    prompts = reference_prompts(1, shared_prefix=60)[3:6]
    llm.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)  # warm the cache
    check_against_hf(hf, llm, prompts)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits >= 2 * 48
    assert kv.window.num_held() == 0 and kv.pool.num_free_blocks == 20
