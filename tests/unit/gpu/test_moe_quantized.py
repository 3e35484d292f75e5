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

from tests.unit.gpu.test_mxfp4 import _write_mxfp4_twins
from tidal.gpu.attention import get_attention_backend
from tidal.gpu.cpu import selector
from tidal.gpu.cpu.kernels import load_cpu_kernels
from tidal.gpu.cpu.packed_linear import PackedLinear
from tidal.gpu.cpu.selector import Plan, PlanCache
from tidal.gpu.layers import ClampedSwiGLU, clamped_swiglu
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.model_loader import LoadOptions, load_model, read_model
from tidal.gpu.moe import GATHERED, ExpertExtras, MoE, Routing, moe_reference, route
from tidal.gpu.quantization import experts as experts_module
from tidal.gpu.quantization.experts import ExpertLinears, QuantExperts, expert_bytes
from tidal.gpu.quantization.linear import DOT, KERNELS, QuantLinear, QuantPacks
from tidal.gpu.quantization.planner import untimed_plan
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


def _quant_linears(model: torch.nn.Module) -> dict[str, QuantLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}


def _layout_tensors(packs: QuantPacks) -> list[torch.Tensor]:
    return [t for layout in (packs.tidal, packs.aten, packs.dot) for t in layout or ()]


@pytest.mark.parametrize("arch,method", [("qwen3_moe", "int8"), ("gpt_oss", "int8"),
                                         ("gpt_oss", "mxfp4")])
def test_an_upgrade_holds_the_serving_models_packed_layouts_not_a_copy(arch, method, tmp_path):
    """A model read again for its timed plans while the first serves (``LoadOptions.reuse``)
    takes the first's packed experts and quantized linears, layout for layout where its plans
    use the same (the two hold one copy, not two), and runs as the first does; a model
    quantized otherwise borrows nothing. gpt-oss's MXFP4 experts as published too."""
    path = build_model_dir(tmp_path / "float", arch, hidden_size=128, head_dim=32)
    quantization = "int8"
    if method == "mxfp4":
        _write_mxfp4_twins(path, tmp_path / "mxfp4")
        path, quantization = tmp_path / "mxfp4", None
    cfg = ModelConfig.from_dir(path)
    first = load_model(path, cfg, _options(quantization=quantization, timed=False)).model
    second = load_model(path, cfg, _options(quantization=quantization, timed=False,
                                            reuse=first)).model
    ours, theirs = _quant_linears(second), _quant_linears(first)
    assert len(ours) == len(theirs) and any(".experts." in name for name in ours)
    for name, layer in ours.items():
        lent, taken = _layout_tensors(theirs[name].packs), _layout_tensors(layer.packs)
        assert lent and len(taken) == len(lent)
        assert all(a is b for a, b in zip(taken, lent)), name
        assert layer.lent is None  # let go once packed
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for block, twin in zip((m for m in second.modules() if isinstance(m, MoE)),
                               (m for m in first.modules() if isinstance(m, MoE))):
            assert torch.equal(block(x), twin(x))
    if method == "mxfp4":
        return  # its experts are MXFP4 under any --quantization
    other = load_model(path, cfg, _options(quantization="int4", timed=False, reuse=first)).model
    held = {id(t) for layer in theirs.values() for t in _layout_tensors(layer.packs)}
    assert not any(id(t) in held for layer in _quant_linears(other).values()
                   for t in _layout_tensors(layer.packs))


@pytest.mark.skipif(not _dot_built(), reason="needs the C++ dot kernel (x86 with AVX2)")
def test_packs_take_the_lent_layouts_they_use_and_make_the_others():
    """``QuantPacks(lent=...)``: a layout the lender has is taken as it is; one it lacks is
    made from the weight, equal to a pack made without a lender."""
    w = quantize(torch.randn(64, 64, generator=torch.Generator().manual_seed(1)), "int8")
    lender = QuantPacks(w, {KERNELS}, torch.float32)
    packs = QuantPacks(w, {KERNELS, DOT}, torch.float32, lent=lender)
    assert packs.tidal is lender.tidal and packs.aten is None
    alone = QuantPacks(w, {DOT}, torch.float32)
    assert lender.dot is None and all(torch.equal(a, b) for a, b in zip(packs.dot, alone.dot))


KIND = "int4g32|float32|tidal,dot,aten,torch"


def test_an_untimed_plan_follows_what_this_host_measured(monkeypatch, tmp_path):
    """Untimed under ``auto`` (a first start serving while its plans are timed), a quantized
    linear takes this host's cached plan of its name, else the choice its cached plans of the
    same kind make most often, else the first candidate; ``force`` always the first."""
    monkeypatch.setattr(selector, "_mode", "auto")
    hints = PlanCache(tmp_path, key={"host": "test"})
    buckets = selector.row_buckets(8)
    timed = Plan((1, 2, 4, 8), (DOT, DOT, DOT, KERNELS))
    hints.plans.update({f"qlinear 64x64 {KIND}": timed, f"qlinear 96x64 {KIND}": Plan.always(DOT),
                        f"qlinear 32x64 {KIND}": Plan.always(DOT),
                        f"qlinear 80x64 {KIND}": Plan.always(DOT),
                        f"qlinear 48x64 {KIND}": Plan.always(KERNELS),
                        "qlinear 64x64 int8|float32|tidal,dot,aten,torch": Plan.always("aten")})
    methods = [KERNELS, DOT, "aten", "torch"]
    assert untimed_plan(f"qlinear 64x64 {KIND}", methods, buckets, hints) == timed  # its own
    assert untimed_plan(f"qlinear 128x64 {KIND}", methods, buckets, hints) == Plan.always(DOT)
    other_kind = "qlinear 128x64 int4g64|float32|tidal,dot,aten,torch"
    assert untimed_plan(other_kind, methods, buckets, hints) == Plan.always(KERNELS)
    assert untimed_plan(f"qlinear 128x64 {KIND}", [KERNELS, "torch"], buckets,
                        hints) == Plan.always(KERNELS)  # dot no candidate here
    assert untimed_plan(f"qlinear 128x64 {KIND}", methods, buckets, None) == Plan.always(KERNELS)
    monkeypatch.setattr(selector, "_mode", "force")
    assert untimed_plan(f"qlinear 64x64 {KIND}", methods, buckets, hints) == Plan.always(KERNELS)


@pytest.mark.skipif(not _dot_built(), reason="needs the C++ dot kernel (x86 with AVX2)")
def test_an_untimed_load_plans_its_experts_as_this_host_measured(monkeypatch, tmp_path):
    """A model loaded untimed under ``auto`` with this host's cache saying its kind of
    quantized linear runs on the dot kernel puts every one of them there (experts, as read,
    and the dense ones), which the timed model will then borrow; under ``force``, tidal's
    kernel."""
    path = build_model_dir(tmp_path / "model", "qwen3_moe", hidden_size=128, head_dim=32)
    cfg = ModelConfig.from_dir(path)

    def planned(mode: str) -> set[str]:
        monkeypatch.setattr(selector, "_mode", mode)
        model = load_model(path, cfg, _options(quantization="int4", timed=False)).model
        return {choice for layer in _quant_linears(model).values() for choice in layer.plan.used()}

    monkeypatch.setenv(selector.CACHE_ENV, str(tmp_path / "plans"))
    assert planned("auto") == {KERNELS}  # nothing measured here yet
    layers = _quant_linears(load_model(path, cfg, _options(quantization="int4",
                                                            timed=False)).model)
    cache = PlanCache()
    for kind in {layer.plan_name.split(" ", 2)[2] for layer in layers.values()}:
        cache.plans[f"qlinear 1x1 {kind}"] = Plan.always(DOT)  # another shape of each kind
        cache.measured.append(f"qlinear 1x1 {kind}")
    cache.save()
    assert planned("auto") == {DOT}
    assert planned("force") == {KERNELS}
