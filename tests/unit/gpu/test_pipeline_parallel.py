"""Pipeline parallelism over gloo on the CPU: two stages (and two stages of two tensor-parallel
ranks) give the greedy tokens and top logprobs of one process, for Llama, Qwen2 and Qwen3,
under chunked prefill, preemption, prefix caching and async scheduling, with a step per stage
in flight (micro-batches); requests that finish or are aborted while another micro-batch is in
flight, and empty steps, neither stall the pipe nor change the others' tokens; the layers split
into contiguous ranges; models and options the stages cannot run are refused before any worker
starts. The one-process engine these compare with is checked against HF transformers in
``test_fidelity.py``."""

from __future__ import annotations

import pytest

from tests.hf_reference import reference_prompts
from tests.unit.gpu.test_tensor_parallel import GREEDY, STRESS, _assert_same, _run
from tidal.core import LLM
from tidal.core.config import EngineConfig
from tidal.core.engine_core import EngineCore
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.pipeline import PipelineStage, check_pipeline_parallel, stage_weights
from tidal.gpu.random_model import build_model_dir

# (arch, TP size, model overrides): three layers split unevenly over two stages; qwen2's head
# tied to its embedding (the last stage holds a copy), with one KV head shared by two TP ranks
CASES = [("llama", 1, {}),
         ("qwen3", 1, {}),
         ("qwen2", 2, dict(num_key_value_heads=1, tie_word_embeddings=True))]
# the first stage's two layers hold 160 tokens: the longest request, not all of them at once
KV_BUDGET = 160 * 2 * 2 * 16 * 4  # tokens x layers x (K, V) x head_dim x float32


def _watch_pipe(monkeypatch) -> list[int]:
    """The steps in flight each time the engine processes the oldest (a spy)."""
    depths: list[int] = []
    process = EngineCore._process_oldest

    def spy(self: EngineCore) -> list:
        depths.append(len(self._pipe))
        return process(self)

    monkeypatch.setattr(EngineCore, "_process_oldest", spy)
    return depths


@pytest.mark.slow
@pytest.mark.parametrize("arch,tp,overrides", CASES)
def test_two_stages_match_one_process(tmp_path_factory, monkeypatch, arch, tp, overrides):
    shape = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3,
             "added_tokens": ("<odd>",), **overrides}
    path = build_model_dir(tmp_path_factory.mktemp(arch), arch, **shape)
    prompts = reference_prompts(5, shared_prefix=24)[:5]  # of 25 to 88 tokens
    (ref, _), _ = _run(path, prompts)
    kv_heads = overrides.get("num_key_value_heads", 2) // tp or 1  # a rank's KV heads
    stress = {**STRESS, "kv_cache_memory": KV_BUDGET * kv_heads}
    depths = _watch_pipe(monkeypatch)
    (first, again), llm = _run(path, prompts, pipeline_parallel_size=2, tensor_parallel_size=tp,
                               **stress)
    _assert_same(ref, first)
    _assert_same(ref, again)
    assert max(depths) == 2, "two micro-batches should have been in flight at once"
    assert len(llm.engine.executor.workers) == 2 * tp
    assert llm.engine.scheduler.num_preemptions > 0, "the workload should preempt"
    assert llm.engine.kv.stats.hits > 0, "the second pass should hit the prefix cache"
    assert not any(p.is_alive() for p in llm.engine.executor.workers), "workers outlived it"


@pytest.mark.slow
def test_micro_batches_survive_aborts_early_finishes_and_empty_steps(tmp_path, monkeypatch):
    """One start of two stages, without async scheduling: requests of different lengths
    (finishing while the other micro-batch is in flight), one alone (empty steps between
    its micro-batches) and one aborted while in flight; the rest keep one process's tokens."""
    path = build_model_dir(tmp_path / "m", "llama", num_attention_heads=4,
                           num_key_value_heads=2, num_hidden_layers=3)
    prompts = reference_prompts(5)[:5]
    params = [GREEDY.clone(max_tokens=n) for n in (3, 24, 7, 1, 16)]
    llm = LLM(str(path), dtype="float32", max_model_len=512)
    try:
        ref = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    depths = _watch_pipe(monkeypatch)
    llm = LLM(str(path), dtype="float32", max_model_len=512, pipeline_parallel_size=2,
              max_num_batched_tokens=48)
    try:
        _assert_same(ref, llm.generate(prompts, params, use_tqdm=False))
        _assert_same(ref[1:2], llm.generate(prompts[1:2], params[1], use_tqdm=False))
        engine = llm.engine
        engine.add_request("victim", list(ref[1].prompt_token_ids), params[1])
        engine.add_request("other", list(ref[4].prompt_token_ids), params[4])
        outputs = {}
        for _ in range(200):
            for out in engine.step():
                outputs[out.request_id] = outputs.get(out.request_id, []) + [out]
            if "victim" in engine.scheduler.in_flight and len(outputs.get("victim", ())) > 2:
                engine.abort_requests(["victim"])
            if not engine.has_unfinished_requests():
                break
        assert not engine.has_unfinished_requests(), "the engine did not finish"
        assert outputs["victim"][-1].finished
        victim = outputs["victim"][-1].outputs[0]
        assert victim.finish_reason == "abort" and len(victim.token_ids) < 24
        other = [t for o in outputs["other"] for t in o.outputs[0].token_ids]
        assert other == ref[4].outputs[0].token_ids
        assert not engine.scheduler.in_flight and not engine._pipe
        _assert_same(ref, llm.generate(prompts, params, use_tqdm=False))  # nothing stuck
    finally:
        llm.shutdown()
    assert max(depths) == 2


def test_stages_hold_contiguous_layers_and_rename_theirs():
    ranges = [PipelineStage(i, 3).layer_range(7) for i in range(3)]
    assert ranges == [range(0, 3), range(3, 5), range(5, 7)]
    second = PipelineStage(1, 2)
    names = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight",
             "model.layers.3.self_attn.q_proj.weight", "model.layers.4.input_layernorm.weight",
             "model.norm.weight", "lm_head.weight"]
    kept = [n for n, _ in stage_weights(((n, None) for n in names), second, 5)]
    assert kept == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                    "model.layers.1.input_layernorm.weight", "model.norm.weight",
                    "lm_head.weight"]
    cfg = _config("LlamaForCausalLM", tie=True)
    assert second.holds_embedding(cfg) and not PipelineStage(1, 3).holds_embedding(cfg)
    assert second.local(cfg).num_layers == 2


def _config(arch: str, layers: int = 5, tie: bool = False) -> ModelConfig:
    return ModelConfig(arch, 101, 32, 64, layers, 4, 2, 8, 1e-6, 64, 10000.0,
                       tie_word_embeddings=tie)


def test_what_the_stages_cannot_run_is_refused(tmp_path):
    with pytest.raises(ValueError, match="Gemma2ForCausalLM is not split into stages"):
        check_pipeline_parallel(_config("Gemma2ForCausalLM"), 2)
    with pytest.raises(ValueError, match="more than the model's 2 layers"):
        check_pipeline_parallel(_config("LlamaForCausalLM", layers=2), 3)
    with pytest.raises(ValueError, match="--quantization"):
        check_pipeline_parallel(_config("LlamaForCausalLM"), 2, quantization="int8")
    check_pipeline_parallel(_config("Gemma2ForCausalLM"), 1)  # one stage: anything goes
    path = str(build_model_dir(tmp_path / "m", "llama"))
    with pytest.raises(ValueError, match="more than the model's 2 layers"):
        LLM(path, pipeline_parallel_size=3)  # before any worker starts
    with pytest.raises(ValueError, match="'uni' runs one rank; pipeline_parallel_size"):
        EngineConfig(path, pipeline_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="pipeline_parallel_size must be a positive integer"):
        EngineConfig(path, pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size x pipeline_parallel_size 2 must"):
        EngineConfig(path, pipeline_parallel_size=2, nnodes=4,
                     distributed_init_method="tcp://h:1")
    assert EngineConfig(path, pipeline_parallel_size=2, tensor_parallel_size=2).world_size == 4
