"""A model read again for its timed plans beside the one serving (a first start's upgrade,
``gpu/cpu/model_upgrade.py``) borrows what that model holds: its packed quantized linears and
experts where the plans agree (``QuantLinear.borrow``, ``QuantPacks(lent=...)``), and untimed
plans follow what this host measured (``planner.untimed_plan``) so that they agree."""

from __future__ import annotations

import pytest
import torch

from tests.unit.gpu.test_cpu_selector import fake_timer, named, scripted
from tests.unit.gpu.test_moe_quantized import _dot_built, _options
from tests.unit.gpu.test_mxfp4 import _write_mxfp4_twins
from tidal.gpu.cpu import selector
from tidal.gpu.cpu.selector import Plan, PlanCache, choose, row_buckets
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.model_loader import load_model
from tidal.gpu.moe import MoE
from tidal.gpu.quantization.linear import DOT, KERNELS, QuantLinear, QuantPacks
from tidal.gpu.quantization.planner import probe, untimed_plan
from tidal.gpu.quantization.weights import quantize
from tidal.gpu.random_model import build_model_dir


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


def test_a_probe_guesses_the_one_layout_that_loses_least_from_three_buckets() -> None:
    """``probe`` times each candidate once at the first, middle and last bucket only,
    drops those hopeless at the first, and keeps the one candidate losing least over the
    three; it agrees with ``choose``'s one layout where the margins are wide."""
    by_rows = {1: {"a": 1.0, "b": 0.8, "torch": 9.0}, 2: {"a": 1.0, "b": 0.9, "torch": 5.0},
               4: {"a": 2.0, "b": 1.0, "torch": 4.0}, 8: {"a": 3.0, "b": 4.0, "torch": 3.5}}
    candidates, exact = scripted(by_rows)
    calls: list[tuple[str, float]] = []

    def timer(name: str, fn, n: int) -> float:
        calls.append((name, exact("a", fn, n)))
        return exact(name, fn, n)

    plan = probe([1, 2, 4, 8], candidates, timer)
    assert plan == Plan.always("b")  # 0.8 + 0.5 + 4/3 of the best, against 1.25 + 2 + 1
    assert {rows for _, rows in calls} == {1.0, 2.0, 3.0}  # buckets 1, 4 and 8 (a's times)
    assert ("torch", 1.0) in calls and ("torch", 2.0) not in calls  # 9.0 > 4 x 0.8
    assert len(calls) == 3 + 2 * 2  # one timing (of PROBE_CALLS calls) each
    assert choose([1, 2, 4, 8], *scripted(by_rows)).single() == "b"
    candidates, timer = scripted({1: {"a": 1.0, "b": 3.0}})
    assert probe([1], candidates, timer) == Plan.always("a")
    seen: list[int] = []
    probe(row_buckets(4096), lambda rows: seen.append(rows) or named(rows, ["a"]),
                   fake_timer({"a": 1.0}))
    assert seen == [1, 16, 256]  # a step of thousands of rows is not called at its size


def test_an_untimed_plan_with_nothing_measured_is_probed(monkeypatch, tmp_path):
    """With no plan of its kind on this host, an untimed quantized linear's plan is a quick
    ``planner.probe`` of its candidates (the hints' timer), not the first candidate; a vote
    of the cached plans comes first, and ``force`` never probes."""
    monkeypatch.setattr(selector, "_mode", "auto")
    costs = {KERNELS: 2.0, DOT: 1.0, "aten": 1.5, "torch": 30.0}
    hints = PlanCache(tmp_path, key={"host": "test"}, timer=lambda name, fn, n: costs[name])
    methods, buckets = [KERNELS, DOT, "aten", "torch"], selector.row_buckets(8)
    probed: list[int] = []

    def candidates():
        probed.append(1)
        return lambda rows: {m: (lambda: None) for m in methods}

    name = f"qlinear 64x64 {KIND}"
    assert untimed_plan(name, methods, buckets, hints, candidates) == Plan.always(DOT)
    costs["aten"] = 0.5
    assert untimed_plan(name, methods, buckets, hints, candidates) == Plan.always("aten")
    assert untimed_plan(name, methods, buckets, hints) == Plan.always(KERNELS)  # no candidates
    hints.plans[f"qlinear 32x64 {KIND}"] = Plan.always(DOT)
    assert untimed_plan(name, methods, buckets, hints, candidates) == Plan.always(DOT)  # voted
    monkeypatch.setattr(selector, "_mode", "force")
    assert untimed_plan(name, methods, buckets, hints, candidates) == Plan.always(KERNELS)
    assert len(probed) == 2


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
    first = {KERNELS: 1.0, DOT: 2.0}  # nothing measured here yet: probed, under this timer
    monkeypatch.setattr(selector, "host_timer", lambda name, fn, n: first.get(name, 9.0))
    assert planned("auto") == {KERNELS}
    first = {KERNELS: 2.0, DOT: 1.0}
    assert planned("auto") == {DOT}
    first = {KERNELS: 1.0, DOT: 2.0}  # the cache's vote below comes before a probe
    layers = _quant_linears(load_model(path, cfg, _options(quantization="int4",
                                                            timed=False)).model)
    cache = PlanCache()
    for kind in {layer.plan_name.split(" ", 2)[2] for layer in layers.values()}:
        cache.plans[f"qlinear 1x1 {kind}"] = Plan.always(DOT)  # another shape of each kind
        cache.measured.append(f"qlinear 1x1 {kind}")
    cache.save()
    assert planned("auto") == {DOT}
    assert planned("force") == {KERNELS}
