"""Packed linear layers: every method (tidal's panels, MKL's pack, oneDNN's pack, torch's own)
gives ``nn.Linear``'s results, and a layer runs each row count on the method its plan names."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tidal.gpu.cpu import packed_linear
from tidal.gpu.cpu.kernels import load_cpu_kernels
from tidal.gpu.cpu.packed_linear import (
    METHODS,
    PackedLinear,
    can_pack,
    candidate_methods,
    pack_linear_layers,
)
from tidal.gpu.cpu.selector import Plan

FLOAT32_METHODS = candidate_methods(torch.float32, load_cpu_kernels())
BF16_METHODS = candidate_methods(torch.bfloat16, load_cpu_kernels())


def _panel_width() -> int:
    kernels = load_cpu_kernels()
    return kernels.linear_panel_width() if kernels is not None else 32


# rows: one, partial row blocks, whole blocks, past a 128-row chunk with a remainder;
# out_features: a partial last panel, fewer than one panel, and a whole number of panels.
@pytest.mark.parametrize("method", FLOAT32_METHODS)
@pytest.mark.parametrize("rows", [1, 5, 7, 64, 300])
@pytest.mark.parametrize("out_features", [200, 5, 2 * _panel_width()])
@pytest.mark.parametrize("bias", [False, True])
def test_every_method_matches_linear_in_float32(method: str, rows: int, out_features: int,
                                                bias: bool) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(96, out_features, bias=bias)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        expected = linear(x)
        got = PackedLinear(linear, Plan.always(method))(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", BF16_METHODS)
def test_bfloat16_methods_keep_leading_dims(method: str) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True).to(torch.bfloat16)
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        got = PackedLinear(linear, Plan.always(method))(x)
        expected = linear(x)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 5, 48)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_bfloat16_uses_onednn_only_where_it_has_a_bfloat16_path() -> None:
    has_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert ("onednn" in BF16_METHODS) == (has_bf16 and torch.backends.mkldnn.is_available())
    assert "panels" not in BF16_METHODS and BF16_METHODS[-1] == "torch"


def test_a_layer_runs_each_row_count_on_its_plans_method() -> None:
    """The plan's method for each row count is the one the C++ layer calls (checked through
    its ``method``) and each gives the same product; only the plan's layouts are packed."""
    kernels = load_cpu_kernels()
    if kernels is None or len(FLOAT32_METHODS) < 3:
        pytest.skip("needs the C++ kernels")
    methods = FLOAT32_METHODS
    plan = Plan(tuple(range(2, 2 * len(methods) + 1, 2)), tuple(methods))  # 2 rows each
    torch.manual_seed(0)
    linear = nn.Linear(40, 70)
    layer = PackedLinear(linear, plan)
    for rows in range(1, 2 * len(methods) + 3):
        expected = plan.pick(rows)
        assert METHODS[layer.kernel.method(rows)] == expected
        x = torch.randn(rows, 40)
        with torch.inference_mode():
            torch.testing.assert_close(layer(x), linear(x), rtol=1e-5, atol=1e-5)
    one = PackedLinear(linear, Plan.always("panels"))
    assert one.plain_weight is None and one.onednn_weight is None and one.mkl_weight is None


def test_float32_gemm_reads_strided_rows_and_checks_its_inputs() -> None:
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("the C++ CPU kernels are not built here")
    torch.manual_seed(0)
    weight = torch.randn(40, 24)
    panels = kernels.pack_linear_weight(weight)
    assert panels.shape[2] == kernels.linear_panel_width()
    wide = torch.randn(9, 50)
    x = wide[:, 3:27]  # rows 50 floats apart
    torch.testing.assert_close(kernels.packed_linear(x, panels, 40, None), x @ weight.t(),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="features"):
        kernels.packed_linear(torch.randn(3, 23), panels, 40, None)
    with pytest.raises(RuntimeError, match="out_features"):
        kernels.packed_linear(torch.randn(3, 24), panels, 40 + 2 * panels.shape[2], None)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.packed_linear(torch.randn(3, 24, dtype=torch.float64), panels, 40, None)


def test_mkl_reads_strided_and_repeated_rows() -> None:
    if "mkl" not in FLOAT32_METHODS:
        pytest.skip("no MKL packing here")
    kernels = load_cpu_kernels()
    torch.manual_seed(0)
    weight, bias = torch.randn(200, 96), torch.randn(200)
    mkl = kernels.mkl_pack_linear_weight(weight)
    x = torch.randn(130, 200)[:, 7:103]  # rows 200 floats apart
    torch.testing.assert_close(kernels.mkl_linear(x, mkl, 200, bias),
                               torch.addmm(bias, x, weight.t()), rtol=1e-5, atol=1e-5)
    repeated = torch.randn(1, 96).expand(128, 96)  # one row at stride 0
    torch.testing.assert_close(kernels.mkl_linear(repeated, mkl, 200, None),
                               repeated @ weight.t(), rtol=1e-5, atol=1e-5)


def test_panel_width_fits_the_isa_built_for() -> None:
    """Two registers wide: 32 columns where the build has AVX-512, 16 where it has AVX2 (the
    x86-64-v3 baseline), so the microkernel's tile stays in registers."""
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("the C++ CPU kernels are not built here")
    from tidal.gpu.cpu.host import cpu_flags
    from tidal.gpu.cpu.kernels import target_isa

    native = target_isa() == "native"
    if native and "avx512f" in cpu_flags():
        assert kernels.linear_panel_width() == 32
    elif target_isa() == "x86-64-v3" or (native and "avx2" in cpu_flags()):
        assert kernels.linear_panel_width() == 16


def test_pack_linear_layers_swaps_nested_linears_only() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    x = torch.randn(3, 8)
    with torch.inference_mode():
        expected = model(x)
        assert len(pack_linear_layers(model)) == 2
        got = model(x)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model[2][0], PackedLinear)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_big_models_keep_one_layout_per_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    two = Plan((4, 8), ("panels", "torch"), ({"panels": 1.0, "torch": 3.0},
                                             {"panels": 2.0, "torch": 1.9}))
    assert two.single() == "panels"  # loses 5 % at 8 rows, torch loses 3x at 4

    def layouts(cap: int) -> list[set[str]]:
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))  # 96 float32 weights
        pack_linear_layers(model, two_layouts_max_bytes=cap)
        return [m.plan.used() for m in model]

    monkeypatch.setattr(packed_linear, "plan_linears",
                        lambda linears, max_rows, cache: [two] * len(linears))

    if "panels" not in FLOAT32_METHODS:
        pytest.skip("needs the C++ kernels")
    assert layouts(96 * 4) == [{"panels", "torch"}] * 2
    assert layouts(96 * 4 - 1) == [{"panels"}] * 2


def test_only_cpu_float_dtypes_are_packed() -> None:
    assert can_pack("cpu", torch.bfloat16)
    assert not can_pack("cpu", torch.float16)
    assert not can_pack("cuda", torch.float32)


@pytest.mark.parametrize("method", FLOAT32_METHODS)
def test_one_feature_rows_of_any_stride(method: str) -> None:
    """A row of one feature is contiguous whatever its stride: nn.Linear(1, n) on a transposed
    column works as with F.linear."""
    torch.manual_seed(0)
    linear = nn.Linear(1, 40)
    x = torch.randn(1, 5).t()  # [5, 1], strides (1, 5)
    with torch.inference_mode():
        expected = linear(x)
        got = PackedLinear(linear, Plan.always(method))(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", FLOAT32_METHODS)
def test_inputs_with_strided_features(method: str) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(24, 40)
    x = torch.randn(24, 6).t()  # [6, 24], features 6 floats apart
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(linear, Plan.always(method))(x), linear(x),
                                   rtol=1e-5, atol=1e-5)
