"""Tensor parallelism over gloo on the CPU: two worker processes on loopback give the greedy
tokens and top logprobs of one process, for each architecture, float and quantized, under
chunked prefill, preemption, prefix caching and async scheduling; and each rank's shards put
back together are the whole weights."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest
import torch

from tests.device import TEST_DEVICE, on_test_device
from tests.hf_reference import reference_prompts
from tests.paths import ROOT
from tidal.core import LLM, SamplingParams
from tidal.core.config import EngineConfig
from tidal.core.executor import ExecutorFailedError
from tidal.core.structured_output import StructuredOutputsParams
from tidal.gpu.distributed import TensorParallel
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.quantization.weights import quantize_int4, quantize_int8
from tidal.gpu.random_model import build_model_dir
from tidal.gpu.weight_shards import check_tensor_parallel, local_config, shard_weight

NEW_TOKENS = 24
TOL = 1e-4
# (arch, heads, KV heads): qwen2 has fewer KV heads than ranks, which then share a copy;
# gemma2's sliding windows and soft-capping are per head, as each rank runs them
MODELS = [("llama", 4, 2), ("qwen2", 4, 1), ("qwen3", 4, 2), ("gemma2", 4, 2)]
# sizes that give every model the same KV bytes a token, which STRESS's cache is sized for
OVERRIDES = {"gemma2": dict(head_dim=16, num_hidden_layers=2)}
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
# small steps (chunked prefill), a cache too small for every request at once (preemption),
# the next step scheduled while one runs (async scheduling)
STRESS = dict(max_num_batched_tokens=48, max_num_seqs=8, async_scheduling=True,
              kv_cache_memory=24 * 16 * 256)


def _model(tmp_path_factory, arch: str, heads: int, kv_heads: int):
    # an odd vocabulary, so the last rank's rows of the embedding and head are padded
    return build_model_dir(tmp_path_factory.mktemp(arch), arch, num_attention_heads=heads,
                           num_key_value_heads=kv_heads, added_tokens=("<odd>",),
                           **OVERRIDES.get(arch, {}))


def _run(path, prompts, **engine_args) -> tuple[list, LLM]:
    llm = LLM(str(path), dtype="float32", max_model_len=512, **engine_args)
    try:
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        again = llm.generate(prompts, GREEDY, use_tqdm=False)  # from the prefix cache
    finally:
        llm.shutdown()
    return [first, again], llm


def _assert_same(ref: list, got: list) -> None:
    for want, out in zip(ref, got):
        a, b = want.outputs[0], out.outputs[0]
        assert b.token_ids == a.token_ids, f"prompt of {len(want.prompt_token_ids)} diverged"
        for step, (ref_lp, got_lp) in enumerate(zip(a.logprobs, b.logprobs)):
            assert ref_lp.keys() == got_lp.keys(), f"top tokens differ at step {step}"
            for token, value in ref_lp.items():
                assert abs(got_lp[token] - value) <= TOL, (step, token, value, got_lp[token])


@pytest.mark.slow
@pytest.mark.parametrize("arch,heads,kv_heads", MODELS)
def test_two_ranks_match_one(tmp_path_factory, arch, heads, kv_heads):
    path = _model(tmp_path_factory, arch, heads, kv_heads)
    prompts = reference_prompts(7, shared_prefix=24)
    (ref, _), _ = _run(path, prompts)
    (first, again), llm = _run(path, prompts, tensor_parallel_size=2, **STRESS)
    _assert_same(ref, first)
    _assert_same(ref, again)
    assert llm.engine.scheduler.num_preemptions > 0, "the workload should preempt"
    assert llm.engine.kv.stats.hits > 0, "the second pass should hit the prefix cache"
    assert not any(p.is_alive() for p in llm.engine.executor.workers), "workers outlived it"


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_two_ranks_match_one(tmp_path_factory, quantization):
    path = _model(tmp_path_factory, "llama", 4, 2)
    prompts = reference_prompts(3)[:4]
    (ref, _), _ = _run(path, prompts, quantization=quantization)
    (got, _), _ = _run(path, prompts, quantization=quantization, tensor_parallel_size=2)
    _assert_same(ref, got)


@pytest.mark.slow
def test_seeded_sampling_and_grammars_match_one_process(tmp_path_factory):
    """Every rank samples the same tokens (its own next inputs) as rank 0, which answers; a
    constrained row's bitmask reaches every rank with the plan."""
    path = _model(tmp_path_factory, "llama", 4, 2)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=11, n=2, max_tokens=20,
                             ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=(
                  StructuredOutputsParams(regex=r"[a-e ]{4,12}\.")))]
    texts = []
    for tp in (1, 2):
        llm = LLM(str(path), dtype="float32", tensor_parallel_size=tp)
        try:
            outs = llm.generate(["the quick brown", "a b c"], params, use_tqdm=False)
        finally:
            llm.shutdown()
        texts.append([[c.token_ids for c in o.outputs] for o in outs])
        assert re.fullmatch(r"[a-e ]{4,12}\.", outs[1].outputs[0].text)
    assert texts[1] == texts[0]
    assert texts[1][0][0] != texts[1][0][1], "two choices of one seed should differ"


@pytest.mark.slow
def test_a_worker_that_raises_fails_the_engine_and_every_worker_ends(tmp_path):
    llm = LLM(str(build_model_dir(tmp_path / "m", "llama")), tensor_parallel_size=2)
    workers = llm.engine.executor.workers
    with pytest.raises(ExecutorFailedError, match="rank 0: AttributeError.*no_such_call"):
        llm.engine.executor._call("no_such_call")  # every rank raises on it
    for p in workers:
        p.join(10)
    assert not any(p.is_alive() for p in workers)
    with pytest.raises(ExecutorFailedError):
        llm.generate("hello", GREEDY, use_tqdm=False)


@pytest.mark.gpu
@pytest.mark.slow
def test_a_world_of_one_in_a_worker_process_matches_the_engine_in_process(tmp_path_factory):
    """``distributed_executor_backend="mp"`` runs even one rank in a worker process (on a GPU:
    NCCL's group of one, CUDA graphs in the worker), to the in-process engine's tokens."""
    from tidal.gpu.multiproc_executor import MultiprocExecutor

    path = _model(tmp_path_factory, "llama", 4, 2)
    prompts = reference_prompts(3)[:4]
    (ref, _), _ = _run(path, prompts, **on_test_device())
    (got, again), llm = _run(path, prompts, distributed_executor_backend="mp",
                             **on_test_device())
    assert isinstance(llm.engine.executor, MultiprocExecutor)
    _assert_same(ref, got)
    _assert_same(ref, again)
    assert not any(p.is_alive() for p in llm.engine.executor.workers), "workers outlived it"


@pytest.mark.gpu
def test_the_group_on_the_device_runs_its_collectives():
    """The device's group (NCCL on a GPU, gloo on the CPU) all-reduces device tensors, and
    the gloo group beside it carries Python objects: a world of one, in a fresh process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = textwrap.dedent(f"""
        import torch, torch.distributed as dist
        from tidal.gpu.distributed import init_tensor_parallel, leave_tensor_parallel
        device = "{TEST_DEVICE}"
        if device != "cpu":
            torch.cuda.set_device(device if ":" in device else "cuda:0")
        tp = init_tensor_parallel(0, 1, "tcp://127.0.0.1:{port}", device, timeout_s=60)
        x = torch.arange(4.0, device=device)
        dist.all_reduce(x, group=tp.group)
        box = [{{"plan": [1, 2]}}]
        dist.broadcast_object_list(box, src=0, group=tp.cpu_group)
        print(dist.get_backend(tp.group), x.device.type, x.tolist(), box[0])
        leave_tensor_parallel()
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    backend = "gloo" if TEST_DEVICE == "cpu" else "nccl"
    device = "cpu" if TEST_DEVICE == "cpu" else "cuda"
    want = f"{backend} {device} [0.0, 1.0, 2.0, 3.0] {{'plan': [1, 2]}}"
    assert proc.stdout.splitlines()[-1] == want


def test_an_impossible_split_fails_before_any_worker_starts(tmp_path):
    path = build_model_dir(tmp_path / "m", "llama")
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide"):
        LLM(str(path), tensor_parallel_size=3)


# -- the shards --------------------------------------------------------------------------
def _config(heads: int = 8, kv_heads: int = 2, inter: int = 96, vocab: int = 101) -> ModelConfig:
    return ModelConfig("LlamaForCausalLM", vocab, 32, inter, 1, heads, kv_heads, 4, 1e-6,
                       64, 10000.0)


@pytest.mark.parametrize("size,kv_heads", [(2, 2), (4, 2), (2, 4), (8, 2)])
def test_shards_put_back_together_are_the_weight(size, kv_heads):
    cfg = _config(kv_heads=kv_heads)
    hd, torch_gen = cfg.head_dim, torch.Generator().manual_seed(0)
    q = torch.randn(cfg.num_heads * hd, 32, generator=torch_gen)
    k = torch.randn(kv_heads * hd, 32, generator=torch_gen)
    o = torch.randn(32, cfg.num_heads * hd, generator=torch_gen)
    embed = torch.randn(cfg.vocab_size, 32, generator=torch_gen)
    ranks = [TensorParallel(r, size) for r in range(size)]
    name = "model.layers.0.self_attn.{}.weight"
    assert torch.equal(torch.cat([shard_weight(name.format("q_proj"), q, cfg, t)
                                  for t in ranks]), q)
    assert torch.equal(torch.cat([shard_weight(name.format("o_proj"), o, cfg, t) for t in ranks],
                                 dim=1), o)
    ks = [shard_weight(name.format("k_proj"), k, cfg, t) for t in ranks]
    per_kv = cfg.num_heads // kv_heads
    for t, part in zip(ranks, ks):  # each rank's KV heads are those of its query heads
        local = local_config(cfg, t)
        first_q = t.rank * local.num_heads
        want = k.view(kv_heads, hd, 32)[first_q // per_kv: first_q // per_kv + local.num_kv_heads]
        assert torch.equal(part, want.reshape(-1, 32))
    rows = torch.cat([shard_weight("model.embed_tokens.weight", embed, cfg, t) for t in ranks])
    assert torch.equal(rows[: cfg.vocab_size], embed) and not rows[cfg.vocab_size:].any()


@pytest.mark.parametrize("quantize", [quantize_int8, lambda w: quantize_int4(w, 32)])
def test_quantized_shards_are_the_quantized_weight(quantize):
    cfg = _config(inter=128)
    w = quantize(torch.randn(32, 128, generator=torch.Generator().manual_seed(1)))
    parts = [shard_weight("model.layers.0.mlp.down_proj.weight", w, cfg, TensorParallel(r, 2))
             for r in range(2)]
    assert torch.equal(torch.cat([p.dequantize() for p in parts], dim=1), w.dequantize())
    up = quantize(torch.randn(128, 32, generator=torch.Generator().manual_seed(2)))
    part = shard_weight("model.layers.0.mlp.up_proj.weight", up, cfg, TensorParallel(1, 2))
    assert torch.equal(part.dequantize(), up.dequantize()[cfg.intermediate_size // 2:])


def test_splits_the_model_cannot_take_are_refused():
    with pytest.raises(ValueError, match="3 does not divide the model's 8 attention heads"):
        check_tensor_parallel(_config(), 3)
    with pytest.raises(ValueError, match="KV heads"):
        check_tensor_parallel(replace(_config(heads=12, kv_heads=3), intermediate_size=96), 2)
    check_tensor_parallel(_config(), 8)  # two KV heads over eight ranks: shared copies


def test_config_checks_the_distributed_fields(tmp_path):
    path = str(build_model_dir(tmp_path / "m", "llama"))
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of mp, uni"):
        EngineConfig(path, distributed_executor_backend="mpi")
    with pytest.raises(ValueError, match="'uni' runs one rank"):
        EngineConfig(path, tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(path, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="multiple of nnodes"):
        EngineConfig(path, tensor_parallel_size=3, nnodes=2, distributed_init_method="tcp://h:1")
    with pytest.raises(ValueError, match="distributed_init_method"):
        EngineConfig(path, tensor_parallel_size=2, nnodes=2)
    with pytest.raises(ValueError, match="node_rank"):
        EngineConfig(path, tensor_parallel_size=2, nnodes=2, node_rank=2,
                     distributed_init_method="tcp://h:1")
