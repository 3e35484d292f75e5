"""tidal's integer-dot quantized linear (``gpu/cpu/csrc/dot_linear.cpp``): x's rows rounded to
int8 per block of 32, multiplied by the weight's integers. Against a reference of its own
definition (the weight, with float16 scales and offsets, times the rounded rows, in float64),
for every format it takes (MXFP4's codebook weights among them), at row counts across its tiles
and chunks; against the float linear within the rounding's bound; and through the C++ dispatch
and a quantized model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.unit.gpu.test_quant_kernels import FORMATS, ROWS, K, _random
from tidal.gpu.cpu.kernels import load_cpu_kernels
from tidal.gpu.cpu.selector import Plan
from tidal.gpu.quantization.linear import ACTIVATION_BLOCK as BLOCK
from tidal.gpu.quantization.linear import (
    DOT,
    QuantLinear,
    candidate_methods,
    dot_tile,
    pack_for_dot,
    round_activations,
)
from tidal.gpu.quantization.weights import MXFP4_CODEBOOK, QuantizedWeight

KERNELS = load_cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None or KERNELS.dot_linear_tile()[0] == 0,
                                reason="needs the C++ kernels built for AVX2 or later")


def mxfp4(n: int, seed: int = 0, exponents: tuple[int, int] = (-12, -4)) -> QuantizedWeight:
    """Random MXFP4 codes over its codebook, each group's scale a power of two."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, K), generator=gen).to(torch.uint8)
    e = torch.randint(*exponents, (n, K // 32), generator=gen)
    return QuantizedWeight(4, 32, q, torch.ldexp(torch.ones(e.shape), e),
                           codebook=torch.tensor(MXFP4_CODEBOOK, dtype=torch.int8))


DOT_FORMATS = {**FORMATS, "mxfp4": mxfp4}


def _fits(qw: QuantizedWeight) -> bool:
    return KERNELS.dot_linear_supports(qw.bits, qw.group_size, qw.shape[1])


def reference(qw: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    w = qw.float16_params().dequantize(torch.float64)
    y = round_activations(x.float()).double() @ w.T
    return (y if bias is None else y + bias.double()).float()


@pytest.mark.parametrize("fmt", sorted(DOT_FORMATS))
@pytest.mark.parametrize("out_features", [37, 96])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_is_the_weight_times_the_rounded_rows(fmt, out_features, bias):
    qw = DOT_FORMATS[fmt](out_features)
    if not _fits(qw):
        assert qw.group_size % BLOCK, fmt  # only groups smaller than a block are turned down
        return
    assert DOT in candidate_methods(qw, torch.device("cpu"))
    b = torch.randn(out_features) if bias else None
    layer = QuantLinear(qw, b, plan=Plan.always(DOT))
    for rows in ROWS:
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
        ref = reference(qw, x, b)
        scale = ref.abs().max().item()
        torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-5 * scale,
                                   msg=f"{fmt}, {rows} rows")


@pytest.mark.parametrize("fmt", ["int8", "int4g32"])
def test_rounding_the_rows_stays_close_to_the_float_linear(fmt):
    """The rounding of x costs at most half a step of each block's 255 levels: the result
    stays within a percent of the float linear's scale."""
    qw = FORMATS[fmt](96)
    layer = QuantLinear(qw, plan=Plan.always(DOT))
    x = torch.randn(9, K)
    ref = F.linear(x, qw.dequantize())
    err = (layer(x) - ref).abs().max() / ref.abs().max()
    assert 0 < err < 0.01


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_largest_4bit_block_fits_the_kernels_integer_sums(sign):
    """Every nibble 15 against rows rounded to +-127: the largest sums a block's integer
    products can make (without VNNI they are added in int16 over a block) still come out
    exact."""
    n = 24
    q = torch.full((n, K), 15, dtype=torch.uint8)
    qw = QuantizedWeight(4, 32, q, torch.ones(n, K // 32), torch.zeros(n, K // 32))
    layer = QuantLinear(qw, plan=Plan.always(DOT))
    x = torch.full((3, K), sign)
    assert torch.equal(layer(x), torch.full((3, n), sign * 15.0 * K))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_widest_codebook_blocks_fit_the_kernels_integer_sums(sign):
    """MXFP4's largest entries (12, and -12: 24 above the least, as the kernel multiplies
    them) against rows of +-127, alternating by group so the offsets are exercised: exact."""
    n = 24
    q = torch.full((n, K), 7, dtype=torch.uint8)  # 12
    q[:, 32:64] = 15  # -12
    qw = QuantizedWeight(4, 32, q, torch.ones(n, K // 32),
                         codebook=torch.tensor(MXFP4_CODEBOOK, dtype=torch.int8))
    layer = QuantLinear(qw, plan=Plan.always(DOT))
    x = torch.full((3, K), sign)
    assert torch.equal(layer(x), torch.full((3, n), sign * 12.0 * (K - 64)))


def test_codebook_scales_are_exponents_and_tiny_ones_read_as_zero():
    """Scales of 2^-130 (below float32's normal range) pack as 0 and multiply as 0; scales
    that are no powers of two turn the kernel down, and the layer takes the
    weight as the int8 weight it equals."""
    qw = mxfp4(16, exponents=(-12, -11))
    qw.scales[:, 1] = 2.0 ** -130
    rows, bias = dot_tile(KERNELS)
    packed, params = pack_for_dot(qw, rows, bias)
    assert params.dtype == torch.uint8 and params.numel() == 16 + 2 * rows * (K // 32)
    assert torch.equal(params[:16].view(torch.int8), qw.codebook)
    assert torch.equal(params[16:16 + rows], torch.full((rows,), 127 - 12, dtype=torch.uint8))
    assert torch.equal(params[16 + rows:16 + 2 * rows], torch.zeros(rows, dtype=torch.uint8))
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(3))
    flushed = QuantizedWeight(4, 32, qw.q, qw.scales.clone(), codebook=qw.codebook)
    flushed.scales[:, 1] = 0
    got = QuantLinear(qw, plan=Plan.always(DOT))(x)
    ref = reference(flushed, x, None)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    for bad in (3.0, 0.75):
        odd = QuantizedWeight(4, 32, qw.q, qw.scales.clone(), codebook=qw.codebook)
        odd.scales[0, 0] = bad
        assert candidate_methods(odd, torch.device("cpu")) == ["torch"]
        layer = QuantLinear(odd)
        assert layer.bits == 8 and not layer.codebook
        want = F.linear(x, odd.dequantize())
        torch.testing.assert_close(layer(x), want, rtol=1e-5,
                                   atol=1e-5 * want.abs().max().item())


def test_a_codebook_weight_on_torchs_path_is_its_dequantized_weight():
    """The exact path, from Python and from the C++ dispatch (which dequantizes the int8
    weight the codebook weight equals)."""
    qw = mxfp4(40)
    assert candidate_methods(qw, torch.device("cpu")) == [DOT, "torch"]
    layer = QuantLinear(qw, torch.randn(40), plan=Plan.always("torch"))
    assert layer.format_name == "mxfp4g32"
    x = torch.randn(5, K)
    want = F.linear(x, qw.dequantize(), layer.bias)
    assert torch.equal(layer(x), want)
    assert torch.equal(layer.packs.run("torch", x, layer.bias), want)


def test_zero_rows_and_blocks_give_the_bias():
    qw = FORMATS["int4g32"](40)
    bias = torch.randn(40)
    layer = QuantLinear(qw, bias, plan=Plan.always(DOT))
    x = torch.zeros(3, K)
    x[1, BLOCK:2 * BLOCK] = 1.0  # one block of one row not zero
    y = layer(x)
    assert torch.equal(y[0], bias) and torch.equal(y[2], bias)
    torch.testing.assert_close(y[1:2], reference(qw, x[1:2], bias), rtol=1e-5, atol=1e-5)


def test_the_pack_puts_each_value_where_the_kernel_reads_it():
    rows, bias = dot_tile(KERNELS)
    qw = _random(4, 32, 3, offsets=True)
    packed, params = pack_for_dot(qw, rows, bias)
    assert packed.numel() == rows * K // 2 and params.dtype == torch.float16
    first = packed[:4 * rows].view(rows, 4)  # item 0, inputs 0-7 of each row
    assert torch.equal(first[:3] & 15, qw.q[:, 0:4])
    assert torch.equal(first[:3] >> 4, qw.q[:, 4:8])
    assert torch.equal(first[3:], torch.zeros_like(first[3:]))  # the padding rows
    assert torch.equal(params[:3], qw.scales[:, 0].half())
    assert torch.equal(params[rows:rows + 3], qw.offsets[:, 0].half())
    int8 = _random(8, 32, 3, offsets=False)
    packed, params = pack_for_dot(int8, rows, bias)
    stored = int8.q[:, :4].view(torch.uint8)
    assert torch.equal(packed[:4 * rows].view(rows, 4)[:3], stored ^ 0x80 if bias else stored)
    assert torch.equal(pack_for_dot(int8, rows, 128)[0][:4 * rows].view(rows, 4)[:3],
                       stored ^ 0x80)
    assert params.numel() == rows * K // 32


def test_scales_float16_cannot_hold_turn_the_kernel_down():
    qw = _random(4, 32, 8, offsets=True)
    assert DOT in candidate_methods(qw, torch.device("cpu"))
    qw.scales[0, 0] = 1e-6  # below float16's normal range
    assert DOT not in candidate_methods(qw, torch.device("cpu"))


def test_bfloat16_activations_are_widened_for_the_kernel():
    qw = FORMATS["int4g32"](96)
    assert DOT in candidate_methods(qw, torch.device("cpu"), torch.bfloat16)
    layer = QuantLinear(qw, None, torch.bfloat16, Plan.always(DOT))
    x = torch.randn(5, K).to(torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, reference(qw, x.float(), None).to(torch.bfloat16),
                               rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("fmt", sorted(DOT_FORMATS))
@pytest.mark.parametrize("shared", [True, False], ids=["one_row", "row_each"])
def test_several_weights_in_one_call_are_each_weights_own_call(fmt, shared):
    """``dot_linear_experts``: weight e over x's row e (or all over its one row), in one
    parallel region, equal to ``dot_linear`` per weight and within the reference's rounding;
    bfloat16 rows widened alike."""
    weights = [DOT_FORMATS[fmt](37) if e == 0 else _random_like(DOT_FORMATS[fmt](37), e)
               for e in range(3)]
    qw = weights[0]
    if not _fits(qw):
        return
    packs = [pack_for_dot(w, *dot_tile(KERNELS)) for w in weights]
    x = torch.randn(1 if shared else 3, K, generator=torch.Generator().manual_seed(7))
    for dtype in (torch.float32, torch.bfloat16):
        xs = x.to(dtype)
        got = KERNELS.dot_linear_experts(xs, [p for p, _ in packs], [s for _, s in packs],
                                         qw.bits, qw.group_size, 37)
        for e, (packed, params) in enumerate(packs):
            row = xs[0 if shared else e][None]
            alone = KERNELS.dot_linear(row, packed, params, qw.bits, qw.group_size, 37, None)
            assert torch.equal(got[e], alone[0]), (fmt, e, dtype)
        if dtype == torch.float32:
            for e, w in enumerate(weights):
                ref = reference(w, x[0 if shared else e][None], None)[0]
                torch.testing.assert_close(got[e], ref, rtol=1e-5,
                                           atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("fmt", sorted(DOT_FORMATS))
def test_weights_over_their_own_rows_in_one_call_are_each_weights_own_call(fmt):
    """``dot_linear_groups``: weight g over its run of rows (1, 2, 5 and 70 of them: a lone
    row, a tile, a tile and a half, past a chunk), equal to ``dot_linear`` over those rows,
    bfloat16 rows too; rows between the runs are left to the caller."""
    counts, gap = [1, 2, 5, 70], 3
    weights = [_random_like(DOT_FORMATS[fmt](37), g + 1) for g in range(len(counts))]
    qw = weights[0]
    if not _fits(qw):
        return
    packs = [pack_for_dot(w, *dot_tile(KERNELS)) for w in weights]
    starts = [sum(counts[:g]) + gap * g for g in range(len(counts))]
    x = torch.randn(starts[-1] + counts[-1], K, generator=torch.Generator().manual_seed(8))
    for dtype in (torch.float32, torch.bfloat16):
        xs = x.to(dtype)
        got = KERNELS.dot_linear_groups(xs, [p for p, _ in packs], [s for _, s in packs],
                                        starts, counts, qw.bits, qw.group_size, 37)
        assert got.shape == (x.shape[0], 37) and got.dtype == dtype
        for (packed, params), start, n in zip(packs, starts, counts):
            alone = KERNELS.dot_linear(xs[start:start + n], packed, params, qw.bits,
                                       qw.group_size, 37, None)
            assert torch.equal(got[start:start + n], alone), (fmt, start, dtype)
    with pytest.raises(RuntimeError, match="out of range"):
        KERNELS.dot_linear_groups(x, [packs[0][0]], [packs[0][1]], [x.shape[0] - 1], [2],
                                  qw.bits, qw.group_size, 37)


def _random_like(qw: QuantizedWeight, seed: int) -> QuantizedWeight:
    """Another weight of ``qw``'s format and shape: its values permuted by ``seed``."""
    perm = torch.randperm(qw.shape[0], generator=torch.Generator().manual_seed(seed))
    return QuantizedWeight(qw.bits, qw.group_size, qw.q[perm], qw.scales[perm],
                           None if qw.offsets is None else qw.offsets[perm], qw.codebook)
