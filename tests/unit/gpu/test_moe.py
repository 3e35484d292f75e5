"""The mixture-of-experts layer (``gpu/moe.py``): its grouped and gathered paths against a
token-by-token loop, its routing and whole block against HF transformers' on the same weights,
both checkpoint forms of the experts, the timed choice between the paths, and what refuses MoE
models (an expert width tensor parallelism cannot split) or leaves them out (the one-call
decode step)."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from tidal.gpu.attention import get_attention_backend
from tidal.gpu.cpu import selector
from tidal.gpu.cpu.selector import PlanCache
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.model_loader import LoadOptions, load_model, read_model
from tidal.gpu.moe import (
    GATHERED,
    GROUPED,
    MoE,
    Routing,
    moe_gathered,
    moe_grouped,
    moe_reference,
    route,
)
from tidal.gpu.random_model import build_model_dir
from tidal.gpu.weight_shards import check_tensor_parallel

E, H, INTER = 8, 32, 16  # experts, hidden, expert intermediate
ROUTINGS = [Routing(2, True), Routing(2, False), Routing(3, True, float32_weights=True)]


def _weights(seed: int = 0, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, 2 * INTER, H, generator=g) * 0.3
    down = torch.randn(E, H, INTER, generator=g) * 0.3
    return gate_up.to(dtype), down.to(dtype)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("tokens", [0, 1, 3, 40])
def test_grouped_and_gathered_paths_equal_the_token_loop(routing, tokens):
    """Tokens routed to only three of the eight experts: the others get no rows."""
    gate_up, down = _weights()
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=g)
    logits = torch.randn(tokens, E, generator=g)
    logits[:, [0, 2, 4, 6, 7]] = -30.0  # experts 1, 3, 5 only
    weights, ids = route(logits, routing)
    assert tokens == 0 or set(ids.unique().tolist()) <= {1, 3, 5}
    want = moe_reference(x, gate_up, down, weights, ids, routing)
    for path in (moe_grouped, moe_gathered):
        got = path(x, gate_up, down, weights, ids, routing)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_paths_in_bfloat16_stay_near_the_float32_loop():
    routing = Routing(2, True)
    gate_up, down = _weights(1)
    x = torch.randn(12, H)
    weights, ids = route(torch.randn(12, E), routing)
    want = moe_reference(x, gate_up, down, weights, ids, routing)
    bf = [t.bfloat16() for t in (x, gate_up, down)]
    for path in (moe_grouped, moe_gathered):
        got = path(*bf, weights, ids, routing).float()
        torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)


def _hf_block(arch: str, norm_topk_prob: bool):
    if arch == "mixtral":
        config = MixtralConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E,
                               num_experts_per_tok=2)
        return MixtralSparseMoeBlock(config), Routing(2, True, float32_weights=True)
    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=INTER, num_experts=E,
                            num_experts_per_tok=2, norm_topk_prob=norm_topk_prob)
    return Qwen3MoeSparseMoeBlock(config), Routing(2, norm_topk_prob)


@pytest.mark.parametrize("arch,norm", [("qwen3_moe", True), ("qwen3_moe", False),
                                       ("mixtral", True)])
def test_block_equals_hf_sparse_moe_block(arch, norm):
    """Routing (softmax, top-k, renormalising or not) and experts, as HF's block computes."""
    hf, routing = _hf_block(arch, norm)
    ours = MoE(H, INTER, E, routing)
    gate_up, down = _weights(2)
    with torch.no_grad():
        hf.gate.weight.normal_(0, 0.5)
        hf.experts.gate_up_proj.copy_(gate_up)
        hf.experts.down_proj.copy_(down)
        ours.gate.weight.copy_(hf.gate.weight)
        ours.experts.gate_up_proj.copy_(gate_up)
        ours.experts.down_proj.copy_(down)
        x = torch.randn(1, 20, H)
        want = hf(x)[0]
        _, hf_weights, hf_ids = hf.gate(x[0])
        weights, ids = route(ours.gate(x[0]), routing)
        assert torch.equal(ids, hf_ids)
        torch.testing.assert_close(weights, hf_weights.float(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ours(x[0]), want, atol=1e-5, rtol=1e-5)


def _options(**kw) -> LoadOptions:
    return LoadOptions(get_attention_backend("torch", "cpu"), 128, torch.float32, "cpu", **kw)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_per_expert_and_fused_checkpoints_load_alike(arch, tmp_path):
    """A published checkpoint's per-expert matrices (Qwen3-MoE's gate/up/down_proj, Mixtral's
    block_sparse_moe w1/w3/w2) and transformers 5's fused 3-D tensors give the same model, the
    HF model's weights."""
    per_expert = build_model_dir(tmp_path / "per_expert", arch)
    assert any(".experts.0." in k for k in _safetensors_keys(per_expert))
    hf = AutoModelForCausalLM.from_pretrained(per_expert, dtype=torch.float32)
    fused = tmp_path / "fused"
    shutil.copytree(per_expert, fused)
    (fused / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()},
              str(fused / "model.safetensors"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in _safetensors_keys(fused)
    cfg = ModelConfig.from_dir(per_expert)
    a, b = read_model(per_expert, cfg, _options()), read_model(fused, cfg, _options())
    hf_params = dict(hf.model.named_parameters())
    for name, param in a.named_parameters():
        assert torch.equal(param, dict(b.named_parameters())[name]), name
    experts = a.layers[0].mlp.experts
    assert torch.equal(experts.gate_up_proj, hf_params["layers.0.mlp.experts.gate_up_proj"])
    assert torch.equal(experts.down_proj, hf_params["layers.0.mlp.experts.down_proj"])
    assert torch.equal(a.layers[0].mlp.gate.weight, hf_params["layers.0.mlp.gate.weight"])


def _safetensors_keys(path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return list(f.keys())


def test_config_reads_the_moe_layout(tmp_path):
    path = build_model_dir(tmp_path / "q", "qwen3_moe", num_hidden_layers=4,
                           decoder_sparse_step=2, mlp_only_layers=[3])
    qwen = ModelConfig.from_dir(path)
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size) == (8, 2, 32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf_sparse = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    assert [qwen.is_moe_layer(i) for i in range(4)] == hf_sparse == [False, True, False, False]
    mixtral = ModelConfig.from_dir(build_model_dir(tmp_path / "m", "mixtral"))
    assert mixtral.norm_topk_prob and mixtral.moe_intermediate_size == mixtral.intermediate_size
    assert all(mixtral.is_moe_layer(i) for i in range(mixtral.num_layers))
    check_tensor_parallel(mixtral, 2)  # each rank a slice of every expert
    with pytest.raises(ValueError, match="expert intermediate size of 33"):
        check_tensor_parallel(replace(qwen, moe_intermediate_size=33), 2)


def test_timed_plan_reaches_every_moe_layer(tmp_path, monkeypatch):
    """Timings that make the gathered path win give every MoE layer that plan; the model's
    logits stay the grouped path's; no one-call decode step is built for a MoE model."""
    from tidal.gpu.attention.paged_layout import paged_layout, random_caches

    monkeypatch.setenv(selector.MODE_ENV, "auto")
    path = build_model_dir(tmp_path / "m", "mixtral")
    cfg = ModelConfig.from_dir(path)
    cache = PlanCache(tmp_path / "cache", timer=lambda name, fn, calls: (
        1.0 if name in (GATHERED, selector.TORCH) else 5.0))
    model, cpu = load_model(path, cfg, _options(max_rows=16, max_seqs=4, plan_cache=cache))
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert len(layers) == cfg.num_layers and all(m.plan.used() == {GATHERED} for m in layers)
    assert cpu.stack is None
    ids = torch.tensor([3, 7, 11, 2])
    meta = paged_layout([0], [4], 16, seed=0)
    caches = [random_caches(meta, 16, cfg.num_kv_heads, cfg.head_dim)
              for _ in range(cfg.num_layers)]
    with torch.inference_mode():
        got = model(ids, torch.arange(4), [tuple(c.clone() for c in kv) for kv in caches], meta)
        for m in layers:
            m.plan = None  # the grouped path
        want = model(ids, torch.arange(4), [tuple(c.clone() for c in kv) for kv in caches], meta)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    candidates = layers[0].candidates(4)
    assert set(candidates) == {GROUPED, GATHERED}
    torch.testing.assert_close(candidates[GATHERED](), candidates[GROUPED](), atol=1e-5,
                               rtol=1e-5)
