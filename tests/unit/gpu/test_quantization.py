"""Weight-only quantization: the affine form, the quantizers, and every method of
``QuantLinear`` against the dequantized weight's ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tidal.gpu.cpu.selector import KERNELS, TORCH, Plan, PlanCache
from tidal.gpu.quantization.linear import (
    ATEN,
    DOT,
    QuantLinear,
    candidate_methods,
    round_activations,
)
from tidal.gpu.quantization.planner import plan_quant_linears
from tidal.gpu.quantization.weights import QuantizedWeight, cat_rows, quantize_int4, quantize_int8


def _weight(n: int = 96, k: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k ** -0.5


def test_int8_rounds_each_weight_to_within_half_a_step():
    w = _weight()
    qw = quantize_int8(w)
    assert qw.q.dtype == torch.int8 and qw.per_channel and qw.offsets is None
    err = (qw.dequantize() - w).abs()
    assert (err <= qw.scales / 2 + 1e-7).all()
    assert qw.nbytes == 96 * 256 + 96 * 4


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_rounds_each_weight_to_within_half_a_step_of_its_group(group):
    w = _weight()
    qw = quantize_int4(w, group)
    assert qw.q.dtype == torch.uint8 and int(qw.q.max()) <= 15
    step = qw.scales.repeat_interleave(group, dim=1)
    assert ((qw.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    assert qw.nbytes == 96 * 256 // 2 + 2 * 96 * (256 // group) * 4


def test_bad_formats_are_refused_naming_what_is_wrong():
    with pytest.raises(ValueError, match="group size"):
        quantize_int4(_weight(), 48)
    with pytest.raises(ValueError, match="uint8"):
        QuantizedWeight(4, 32, torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 2))
    with pytest.raises(ValueError, match="scales must be"):
        QuantizedWeight(8, 32, torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 3))


def test_fused_rows_dequantize_as_their_parts():
    parts = [quantize_int4(_weight(n, seed=n), 32) for n in (64, 16, 16)]
    fused = cat_rows(parts)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    assert torch.equal(fused.narrow_rows(64, 16).dequantize(), parts[1].dequantize())


FORMATS = {"int8": quantize_int8, "int4g32": lambda w: quantize_int4(w, 32),
           "int4g128": lambda w: quantize_int4(w, 128)}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_every_method_matches_the_dequantized_linear(fmt, dtype, rows):
    qw = FORMATS[fmt](_weight())
    bias = torch.randn(96)
    x = torch.randn(rows, 256)
    ref = F.linear(x, qw.dequantize(), bias)
    # the dot kernel multiplies x's rows rounded to int8, by float16 scales and offsets
    dot_ref = F.linear(round_activations(x.to(dtype).float()),
                       qw.float16_params().dequantize(), bias)
    methods = candidate_methods(qw, torch.device("cpu"))
    assert ATEN in methods and methods[-1] == TORCH
    tol = 1e-4 if dtype == torch.float32 else 6e-2
    for method in methods:
        layer = QuantLinear(qw, bias, dtype, Plan.always(method))
        y = layer(x.to(dtype))
        assert y.dtype == dtype
        torch.testing.assert_close(y.float(), dot_ref if method == DOT else ref, atol=tol,
                                   rtol=tol, msg=method)


def test_formats_torch_has_no_op_for_take_the_dequantizing_path():
    w = _weight()
    grouped_int8 = QuantizedWeight(8, 32, quantize_int8(w).q, torch.full((96, 8), 0.01))
    assert ATEN not in candidate_methods(grouped_int8, torch.device("cpu"))
    layer = QuantLinear(grouped_int8, plan=Plan.always(TORCH))
    x = torch.randn(3, 256)
    torch.testing.assert_close(layer(x), F.linear(x, grouped_int8.dequantize()))


def test_planning_keeps_only_the_layouts_the_plan_uses(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_CPU_KERNELS", "auto")
    model = torch.nn.Sequential(QuantLinear(quantize_int4(_weight(), 32)),
                                QuantLinear(quantize_int4(_weight(seed=1), 32)))
    fast = {KERNELS: 2.0, DOT: 3.0, ATEN: 1.0, TORCH: 5.0}
    cache = PlanCache(tmp_path, key={"host": "test"},
                      timer=lambda name, fn, calls: (fn(), fast[name])[1])
    plans = plan_quant_linears(model, 8, cache)
    assert len(plans) == 1  # one shape and format: timed once
    for layer in model:
        assert layer.plan.used() == {ATEN}
        assert layer.weight_format is None  # the unpacked values are gone
    x = torch.randn(2, 256)
    ref = F.linear(x, quantize_int4(_weight(), 32).dequantize())
    torch.testing.assert_close(model[0](x), ref, atol=1e-4, rtol=1e-4)


def test_a_large_quantized_model_keeps_one_layout_per_weight(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_CPU_KERNELS", "auto")
    two = Plan((1, 8), (ATEN, TORCH), ({ATEN: 1.0, TORCH: 2.0}, {ATEN: 9.0, TORCH: 3.0}))
    cache = PlanCache(tmp_path, key={"host": "test"})
    monkeypatch.setattr(cache, "get_or_choose", lambda *args: two)
    small = torch.nn.Sequential(QuantLinear(quantize_int4(_weight(), 32)))
    assert plan_quant_linears(small, 8, cache)  # within the bound: both layouts
    assert small[0].plan.used() == {ATEN, TORCH}
    large = torch.nn.Sequential(QuantLinear(quantize_int4(_weight(), 32)))
    plan_quant_linears(large, 8, cache, two_layouts_max_bytes=0)
    assert large[0].plan.used() == {TORCH}  # the one losing least over both buckets
    x = torch.randn(3, 256)
    torch.testing.assert_close(large[0](x), small[0](x), atol=1e-4, rtol=1e-4)
