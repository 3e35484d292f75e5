"""Quantized experts (``gpu/quantization/experts.py``): the MoE block over int8 and int4
experts against the token loop on the same weights dequantized, and ``--quantization``'s
loading: every expert quantized as the dense linears' quantizers give it, from both checkpoint
forms, with no float experts kept beside them, and on the CPU each layer's packed as read."""

from __future__ import annotations

import shutil
import weakref

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from tidal.gpu.attention import get_attention_backend
from tidal.gpu.cpu.kernels import load_cpu_kernels
from tidal.gpu.cpu.packed_linear import PackedLinear
from tidal.gpu.cpu.selector import Plan
from tidal.gpu.layers import ClampedSwiGLU, clamped_swiglu
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.model_loader import LoadOptions, load_model, read_model
from tidal.gpu.moe import GATHERED, ExpertExtras, MoE, Routing, moe_reference, route
from tidal.gpu.quantization import experts as experts_module
from tidal.gpu.quantization.experts import ExpertLinears, QuantExperts, expert_bytes
from tidal.gpu.quantization.linear import DOT, KERNELS, QuantLinear, QuantPacks
from tidal.gpu.quantization.weights import quantize
from tidal.gpu.random_model import build_model_dir

E, H, INTER = 8, 64, 32  # experts, hidden, expert intermediate (int4 groups of 32)


def _quantized_block(method: str, bias: bool, inter: int = INTER
                     ) -> tuple[MoE, torch.Tensor, torch.Tensor]:
    """A block whose experts are ``method``, and its experts' weights dequantized, stacked."""
    g = torch.Generator().manual_seed(0)
    activation = ClampedSwiGLU(1.0) if bias else None
    moe = MoE(H, inter, E, Routing(2, not bias, softmax_after_topk=bias), bias=bias,
              **({"activation": activation} if bias else {}))
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    gate_up = [quantize(w, method) for w in moe.experts.gate_up_proj]
    down = [quantize(w, method) for w in moe.experts.down_proj]
    moe.experts = QuantExperts([QuantLinear(w) for w in gate_up], [QuantLinear(w) for w in down],
                               moe.experts.gate_up_proj_bias, moe.experts.down_proj_bias)
    return (moe, torch.stack([w.dequantize() for w in gate_up]),
            torch.stack([w.dequantize() for w in down]))


@pytest.mark.parametrize("bias", [False, True], ids=["plain", "gpt_oss"])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_block_equals_the_token_loop_on_dequantized_weights(method, bias):
    """Each expert's GEMMs through its ``QuantLinear`` over its own rows (experts no token
    chose included), a gathered plan too (quantized experts take the grouped path)."""
    moe, gate_up, down = _quantized_block(method, bias)
    assert moe.quantized and not any(p.dim() == 3 for p in moe.parameters())
    extras = ExpertExtras(moe.experts.gate_up_proj_bias, moe.experts.down_proj_bias,
                          moe.activation) if bias else moe.extras()
    for tokens in (0, 1, 3, 40):
        x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))
        with torch.no_grad():
            weights, ids = route(moe.gate(x), moe.routing)
            want = moe_reference(x, gate_up, down, weights, ids, moe.routing, extras)
            moe.plan = None
            torch.testing.assert_close(moe(x), want, atol=1e-4, rtol=1e-4)
            moe.plan = Plan.always(GATHERED)
            torch.testing.assert_close(moe(x), want, atol=1e-4, rtol=1e-4)


def _dot_built() -> bool:
    kernels = load_cpu_kernels()
    return kernels is not None and kernels.dot_linear_supports(8, 32, 32)


@pytest.mark.skipif(not _dot_built(), reason="needs the C++ dot kernel (x86 with AVX2)")
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_lone_rows_experts_run_in_one_dot_call_per_projection(method, monkeypatch):
    """A decode row's experts on the dot kernel: each projection of all of them in one call
    (``dot_linear_experts``), bit for bit what a call per expert gives; experts on another
    method at one row take the loop."""
    moe = _planned_block(method, DOT)
    kernels = moe.experts.down_proj[0].packs.kernels
    calls = []
    together = kernels.dot_linear_experts
    monkeypatch.setattr(kernels, "dot_linear_experts",
                        lambda x, *args: calls.append(tuple(x.shape)) or together(x, *args))
    for seed in range(4):
        x = torch.randn(1, H, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            got = moe(x)
            with monkeypatch.context() as m:
                m.setattr(ExpertLinears, "on_dot", lambda self, ids: False)
                want = moe(x)
        assert torch.equal(got, want)
    assert calls == [(1, H), (2, INTER)] * 4  # gate/up over the row, down over each expert's
    chosen = int(route(moe.gate(x), moe.routing)[1][0, 0])
    moe = _planned_block(method, DOT, {chosen: KERNELS})
    calls.clear()
    with torch.no_grad():
        moe(x)
    assert calls == []


def _planned_block(method: str, choice: str, down_choices: dict[int, str] | None = None) -> MoE:
    """``_quantized_block``'s, every expert planned on ``choice`` (down: ``down_choices``'s
    where it names one)."""
    moe, _, _ = _quantized_block(method, bias=False)
    for layer in moe.experts.gate_up_proj:
        layer.replan(Plan.always(choice))
    for e, layer in enumerate(moe.experts.down_proj):
        layer.replan(Plan.always((down_choices or {}).get(e, choice)))
    return moe


def _options(**kw) -> LoadOptions:
    return LoadOptions(get_attention_backend("torch", "cpu"), 128, torch.float32, "cpu", **kw)


def _fused_copy(per_expert, hf, dest):
    """``per_expert``'s directory with transformers 5's fused 3-D experts."""
    shutil.copytree(per_expert, dest)
    (dest / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()},
              str(dest / "model.safetensors"))
    return dest


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantization_quantizes_every_expert_and_drops_the_float_ones(method, tmp_path):
    """Both checkpoint forms give each expert's ``QuantLinear`` the quantizer's own output on
    HF's weights; the experts hold no float weights, their bytes about a quarter of float32's
    (int8; int4's values are a byte each until packed)."""
    per_expert = build_model_dir(tmp_path / "per_expert", "mixtral")
    hf = AutoModelForCausalLM.from_pretrained(per_expert, dtype=torch.float32)
    fused = _fused_copy(per_expert, hf, tmp_path / "fused")
    cfg = ModelConfig.from_dir(per_expert)
    floats = read_model(per_expert, cfg, _options())
    float_bytes = sum(expert_bytes(m) for m in floats.modules() if isinstance(m, MoE))
    for path in (per_expert, fused):
        model = read_model(path, cfg, _options(quantization=method))
        blocks = [m for m in model.modules() if isinstance(m, MoE)]
        assert len(blocks) == cfg.num_layers and all(m.quantized for m in blocks)
        for layer, moe in enumerate(blocks):
            assert list(moe.experts.parameters()) == []
            hf_experts = hf.model.layers[layer].mlp.experts
            for e in range(cfg.num_experts):
                for ours, theirs in ((moe.experts.gate_up_proj[e], hf_experts.gate_up_proj[e]),
                                     (moe.experts.down_proj[e], hf_experts.down_proj[e])):
                    want = quantize(theirs.detach(), method)
                    assert torch.equal(ours.weight_format.q, want.q)
                    assert torch.equal(ours.weight_format.scales, want.scales)
        quant_bytes = sum(expert_bytes(m) for m in blocks)
        assert quant_bytes * (3.5 if method == "int8" else 3) < float_bytes


def test_a_cpu_load_packs_each_layers_experts_as_soon_as_they_are_read(tmp_path, monkeypatch):
    """``load_model`` on the CPU plans and packs a layer's experts once all of them are read:
    each expert's packed layouts are those of the quantizer's own output on HF's weights, and
    no more than one stacked parameter's experts are ever held unpacked at once (the
    quantizer's outputs still alive, counted as each is made; holding them all until the
    model was read kept every layer's)."""
    per_expert = build_model_dir(tmp_path / "per_expert", "mixtral")
    hf = AutoModelForCausalLM.from_pretrained(per_expert, dtype=torch.float32)
    fused = _fused_copy(per_expert, hf, tmp_path / "fused")
    cfg = ModelConfig.from_dir(fused)
    alive: list[weakref.ref] = []
    most = 0

    def counted(weight: torch.Tensor, method: str, group_size: int = 32):
        nonlocal most
        out = quantize(weight, method, group_size)
        alive.append(weakref.ref(out.q))
        most = max(most, sum(ref() is not None for ref in alive))
        return out

    monkeypatch.setattr(experts_module, "quantize", counted)
    model = load_model(fused, cfg, _options(quantization="int4", timed=False)).model
    assert len(alive) == cfg.num_layers * cfg.num_experts * 3  # gate, up and down apart
    assert 0 < most <= 2 * cfg.num_experts  # one layer's gate and up halves at most
    for layer, moe in enumerate(m for m in model.modules() if isinstance(m, MoE)):
        hf_experts = hf.model.layers[layer].mlp.experts
        for e in range(cfg.num_experts):
            for ours, theirs in ((moe.experts.gate_up_proj[e], hf_experts.gate_up_proj[e]),
                                 (moe.experts.down_proj[e], hf_experts.down_proj[e])):
                assert ours.packs is not None and ours.plan_name is not None
                want = QuantPacks(quantize(theirs.detach(), "int4"), ours.plan.used(),
                                  torch.float32)
                for got, ref in ((ours.packs.tidal, want.tidal), (ours.packs.dot, want.dot),
                                 (ours.packs.aten, want.aten)):
                    assert (got is None) == (ref is None)
                    for a, b in zip(got or (), ref or ()):
                        assert torch.equal(a, b)


def _compiled_blocks(arch: str, method: str, dtype: torch.dtype, tmp_path) -> list[MoE]:
    """The MoE blocks of a random ``arch`` model loaded on the CPU with ``method`` experts."""
    path = build_model_dir(tmp_path / arch, arch, hidden_size=128, head_dim=32)
    options = LoadOptions(get_attention_backend("cpu", "cpu"), 128, dtype, "cpu",
                          quantization=method)
    loaded = load_model(path, ModelConfig.from_dir(path), options)
    return [m for m in loaded.model.modules() if isinstance(m, MoE)]


@pytest.mark.skipif(not _dot_built(), reason="needs the C++ kernels' dot kernel (x86 with AVX2)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch,method", [("qwen3_moe", "int4"), ("mixtral", "int8"),
                                         ("gpt_oss", "int4")])
def test_the_compiled_block_is_bitwise_the_python_grouped_path(arch, method, dtype, tmp_path):
    """A CPU load gives each block of quantized experts its C++ form (``compile_blocks``),
    which the block then calls: bit for bit the Python grouped path's output, for a lone row
    (its experts together on the dot kernel, or one by one where a plan says otherwise) and
    for many (Mixtral's routing weights in float32, Qwen3-MoE's rounded; gpt-oss's biases,
    clamped SwiGLU and softmax after the top-k)."""
    blocks = _compiled_blocks(arch, method, dtype, tmp_path)
    assert blocks and all(moe.block is not None for moe in blocks)
    g = torch.Generator().manual_seed(0)
    for moe in blocks:
        for tokens in (1, 2, 9, 40):
            x = torch.randn(tokens, 128, generator=g).to(dtype)
            with torch.no_grad():
                compiled = moe(x)
                block, moe.block = moe.block, None
                python = moe(x)
                moe.block = block
            assert torch.equal(compiled, python)


# each expert's plan: all on the dot kernel, none, or every other one (others: tidal's kernel)
PLANS = {"dot": lambda e: DOT, "kernels": lambda e: KERNELS,
         "mixed": lambda e: DOT if e % 2 else KERNELS}


@pytest.mark.skipif(not _dot_built(), reason="needs the C++ kernels' dot kernel (x86 with AVX2)")
@pytest.mark.parametrize("bias", [False, True], ids=["plain", "gpt_oss"])
@pytest.mark.parametrize("plans", PLANS)
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_the_compiled_block_follows_each_experts_plan(method, plans, bias):
    """Experts planned on the dot kernel run in one ``dot_linear_groups`` call per projection
    (a lone row's in one ``dot_linear_experts`` call where all are), the others one call
    each: bit for bit the Python path, expert by expert, at every row count; gpt-oss's
    biases and activation too."""
    moe, _, _ = _quantized_block(method, bias=bias)
    for e, (gate_up, down) in enumerate(zip(moe.experts.gate_up_proj, moe.experts.down_proj)):
        gate_up.replan(Plan.always(PLANS[plans](e)))
        down.replan(Plan.always(PLANS[plans](e)))
    moe.gate = PackedLinear(moe.gate)
    experts_module.compile_blocks(moe)
    assert moe.block is not None
    g = torch.Generator().manual_seed(0)
    for tokens in (1, 2, 3, 9, 40):
        x = torch.randn(tokens, H, generator=g)
        with torch.no_grad():
            compiled = moe(x)
            block, moe.block = moe.block, None
            assert torch.equal(compiled, moe(x))
            moe.block = block


def test_a_compiled_block_of_experts_the_dot_kernel_cannot_take():
    """int8 experts of 16 inputs (a rank's slice under tensor parallelism): no group the dot
    kernel takes, so every expert runs its own linear, many rows and one."""
    moe, _, _ = _quantized_block("int8", bias=False, inter=16)
    for layer in [*moe.experts.gate_up_proj, *moe.experts.down_proj]:
        layer.replan(Plan.always(KERNELS))
    moe.gate = PackedLinear(moe.gate)
    experts_module.compile_blocks(moe)
    for tokens in (1, 9):
        x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))
        with torch.no_grad():
            compiled = moe(x)
            moe.block, block = None, moe.block
            assert torch.equal(compiled, moe(x))
            moe.block = block


def test_blocks_the_compiled_form_cannot_run_keep_the_python_path():
    """Float experts, a router without a C++ linear, and an activation the C++ block does not
    have keep the Python path."""
    plain, _, _ = _quantized_block("int8", bias=False)  # its router an nn.Linear
    floats = MoE(H, INTER, E, Routing(2, True))
    other, _, _ = _quantized_block("int8", bias=True)
    other.activation = lambda rows: clamped_swiglu(rows, 1.0)
    other.gate = PackedLinear(other.gate)
    for layer in [*other.experts.gate_up_proj, *other.experts.down_proj]:
        layer.replan(Plan.always(KERNELS))
    for moe in (plain, floats, other):
        experts_module.compile_blocks(moe)
        assert moe.block is None
    other.activation = ClampedSwiGLU(1.0)
    experts_module.compile_blocks(other)
    assert other.block is not None
