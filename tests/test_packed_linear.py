"""Packed linear layers (tidal's float32 panel GEMM, oneDNN for bfloat16): same results as
``nn.Linear``, swapped in on the CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpu.cpu.kernels import load_cpu_kernels
from gpu.cpu.packed_linear import PLAIN_GEMM_MIN_ROWS, PackedLinear, can_pack, pack_linear_layers

pytestmark = pytest.mark.skipif(not can_pack("cpu", torch.float32),
                                reason="torch built without oneDNN")


# rows: one, a partial row block, whole blocks, from where MKL's pack takes over, past a
# 128-row chunk with a remainder, and enough for the panels laid out plainly again (without
# MKL's pack); out_features: a partial last panel (200 = 6 x 32 + 8), fewer than one panel.
@pytest.mark.parametrize("rows", [1, 7, 64, 128, 300, PLAIN_GEMM_MIN_ROWS + 3])
@pytest.mark.parametrize("out_features", [200, 5])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("mkl", [True, False], ids=["mkl-pack", "panels-only"])
def test_packed_linear_matches_linear_in_float32(rows: int, out_features: int, bias: bool,
                                                 mkl: bool) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(96, out_features, bias=bias)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        expected = linear(x)
        packed = PackedLinear(linear)
        if not mkl:
            packed.mkl_packed_weight = None  # as on a torch without MKL
        got = packed(x)
    assert packed.own_gemm == (load_cpu_kernels() is not None)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_mkl_pack_takes_steps_from_128_rows() -> None:
    """The panels and MKL's pack are made here from different weights, W and 3W, so the
    product shows which of them answered: the panels below 128 rows, the pack from 128."""
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("the C++ CPU kernels are not built here")
    torch.manual_seed(0)
    weight, bias = torch.randn(200, 96), torch.randn(200)
    mkl = kernels.mkl_pack_linear_weight(3 * weight)
    if mkl is None:
        pytest.skip("torch is built without MKL")
    panels = kernels.pack_linear_weight(weight)
    for rows, scale in ((127, 1), (128, 3), (300, 3)):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(kernels.packed_linear(x, panels, 200, bias, mkl),
                                   torch.addmm(bias, x, scale * weight.t()),
                                   rtol=1e-5, atol=1e-5)
    x = torch.randn(130, 200)[:, 7:103]  # rows 200 floats apart
    torch.testing.assert_close(kernels.packed_linear(x, panels, 200, None, mkl),
                               x @ (3 * weight).t(), rtol=1e-5, atol=1e-5)
    repeated = torch.randn(1, 96).expand(128, 96)  # one row at stride 0
    torch.testing.assert_close(kernels.packed_linear(repeated, panels, 200, None, mkl),
                               repeated @ (3 * weight).t(), rtol=1e-5, atol=1e-5)


def test_float32_gemm_reads_strided_rows_and_checks_its_inputs() -> None:
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("the C++ CPU kernels are not built here")
    torch.manual_seed(0)
    weight = torch.randn(40, 24)
    panels = kernels.pack_linear_weight(weight)
    wide = torch.randn(9, 50)
    x = wide[:, 3:27]  # rows 50 floats apart
    torch.testing.assert_close(kernels.packed_linear(x, panels, 40, None), x @ weight.t(),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="features"):
        kernels.packed_linear(torch.randn(3, 23), panels, 40, None)
    with pytest.raises(RuntimeError, match="out_features"):
        kernels.packed_linear(torch.randn(3, 24), panels, 80, None)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.packed_linear(torch.randn(3, 24, dtype=torch.float64), panels, 40, None)


def test_packed_linear_keeps_leading_dims_and_bfloat16() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True).to(torch.bfloat16)
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        got = PackedLinear(linear)(x)
        expected = linear(x)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 5, 48)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_pack_linear_layers_swaps_nested_linears_only() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    x = torch.randn(3, 8)
    with torch.inference_mode():
        expected = model(x)
        assert pack_linear_layers(model) == 2
        got = model(x)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model[2][0], PackedLinear)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_mkl_pack_only_for_float32_linears_within_the_cap() -> None:
    kernels = load_cpu_kernels()
    if kernels is None or kernels.mkl_pack_linear_weight(torch.ones(1, 1)) is None:
        pytest.skip("no MKL packing here")
    def packs(cap: int) -> list[bool]:
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))  # 96 float32 weights
        pack_linear_layers(model, mkl_pack_max_bytes=cap)
        return [m.mkl_packed_weight is not None for m in model]
    assert packs(96 * 4) == [True, True]
    assert packs(96 * 4 - 1) == [False, False]
    bf16 = PackedLinear(nn.Linear(8, 8).to(torch.bfloat16))
    assert bf16.mkl_packed_weight is None


def test_only_cpu_float_dtypes_are_packed() -> None:
    assert can_pack("cpu", torch.bfloat16)
    assert not can_pack("cpu", torch.float16)
    assert not can_pack("cuda", torch.float32)


def test_float32_gemm_takes_one_feature_rows_of_any_stride() -> None:
    """A row of one feature is contiguous whatever its stride: nn.Linear(1, n) on a transposed
    column works as with F.linear."""
    torch.manual_seed(0)
    linear = nn.Linear(1, 40)
    x = torch.randn(1, 5).t()  # [5, 1], strides (1, 5)
    with torch.inference_mode():
        expected = linear(x)
        got = PackedLinear(linear)(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_packed_linear_takes_inputs_with_strided_features() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(24, 40)
    x = torch.randn(24, 6).t()  # [6, 24], features 6 floats apart
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)
