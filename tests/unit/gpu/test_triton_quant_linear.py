"""The Triton GEMM of quantized weights (``gpu/quantization/triton_linear.py``) against
``F.linear`` over the dequantized weight in float64: int8 per channel and in groups with
offsets, 4-bit in groups of 32, 64 and 128 with offsets, decode and prefill row counts, N not a
multiple of the tile, bias, float32, float16 and bfloat16 activations.

Without CUDA they run in Triton's interpreter on small shapes; the kernel's compiled form is
checked by lowering it to sm_90 cubins (no GPU needed). On a GPU (``TIDAL_TEST_DEVICE``, else
CUDA where there is one) the kernel is compiled and run.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from tests.device import KERNEL_TEST_DEVICE  # noqa: E402
from tests.paths import ROOT
from tidal.gpu.cpu.selector import TORCH, Plan  # noqa: E402
from tidal.gpu.quantization import triton_linear as tq  # noqa: E402
from tidal.gpu.quantization.linear import (  # noqa: E402
    METHODS,
    TRITON,
    QuantLinear,
    candidate_methods,
)
from tidal.gpu.quantization.weights import QuantizedWeight, quantize_int4, quantize_int8  # noqa: E402

pytestmark = pytest.mark.gpu

DEVICE = KERNEL_TEST_DEVICE
K, N = 256, 72  # N: two tiles and a part of 32, one and a part of 64
ROWS = (1, 3, 16, 33, 130)
# (absolute, relative) tolerance: float32 sums in another order; in 16 bits, the result's
# rounding (half a step of its own magnitude) and the sums' order
TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (1e-2, 2 ** -7),
             torch.float16: (1e-2, 2 ** -10)}


def _weight(fmt: str, seed: int = 0) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen)
    if fmt == "int8":
        return quantize_int8(w)
    if fmt == "int8g32":  # grouped, with offsets (as a GGUF's blocks widened to int8 are)
        q = torch.randint(-128, 128, (N, K), generator=gen, dtype=torch.int8)
        scales = torch.rand(N, K // 32, generator=gen) * 0.02 + 1e-3
        offsets = torch.randn(N, K // 32, generator=gen) * 0.1
        return QuantizedWeight(8, 32, q, scales, offsets)
    return quantize_int4(w, int(fmt.removeprefix("int4g")))


def _reference(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None
               ) -> torch.Tensor:
    """The ``torch`` method's maths in float64: the weight dequantized to ``x``'s dtype."""
    return F.linear(x.double(), w.dequantize(x.dtype).double(),
                    None if bias is None else bias.double())


def _check(got: torch.Tensor, x: torch.Tensor, w: QuantizedWeight,
           bias: torch.Tensor | None) -> None:
    assert got.dtype == x.dtype and got.shape == (x.shape[0], w.shape[0])
    atol, rtol = TOLERANCE[x.dtype]
    torch.testing.assert_close(got.double(), _reference(x, w, bias).cpu(), atol=atol,
                               rtol=rtol)


@pytest.mark.parametrize("fmt", ["int8", "int8g32", "int4g32", "int4g64", "int4g128"])
@pytest.mark.parametrize("rows", ROWS)
def test_matches_dequantized_linear_float32(fmt, rows):
    w = _weight(fmt, rows)
    packed = tq.pack_for_triton(w.narrow_rows(0, N))
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, K, generator=gen)
    bias = torch.randn(N, generator=gen) if rows % 2 else None
    got = tq.triton_quant_linear(x.to(DEVICE), _to(packed), _maybe(bias)).cpu()
    _check(got, x, w, bias)


@pytest.mark.parametrize("fmt", ["int8", "int8g32", "int4g32", "int4g128"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 33])
def test_matches_dequantized_linear_16_bit(fmt, dtype, rows):
    w = _weight(fmt, 7)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, K, generator=gen).to(dtype)
    bias = torch.randn(N, generator=gen).to(dtype)
    got = tq.triton_quant_linear(x.to(DEVICE), _to(tq.pack_for_triton(w)), _maybe(bias)).cpu()
    _check(got, x, w, bias)


@pytest.mark.parametrize("split_k", [1, 2, 3])
@pytest.mark.parametrize("blocks", [(16, 16, 32, 4, 2), (16, 64, 128, 4, 2),
                                    (32, 32, 64, 4, 2)])
def test_tiles_and_splits_do_not_change_the_result(split_k, blocks):
    """Groups of 64 inside a tile of 128 inputs, over two tiles of 32, in one of 64; K splits
    that leave a program no tile (3 splits of 2 tiles)."""
    w = _weight("int4g64", 3)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(N)
    got = tq.triton_quant_linear(x.to(DEVICE), _to(tq.pack_for_triton(w)), _maybe(bias),
                                 blocks=blocks, split_k=split_k).cpu()
    _check(got, x, w, bias)


def test_scales_in_the_activations_dtype():
    w = _weight("int4g32", 4)
    x = torch.randn(3, K).to(torch.bfloat16)
    packed = tq.pack_for_triton(w, param_dtype=torch.bfloat16)
    assert packed.scales.dtype == packed.offsets.dtype == torch.bfloat16
    rounded = QuantizedWeight(4, 32, w.q, w.scales.bfloat16().float(),
                              w.offsets.bfloat16().float())
    _check(tq.triton_quant_linear(x.to(DEVICE), _to(packed)).cpu(), x, rounded, None)


def test_pack_layout():
    """4-bit: byte j of a row holds input 2j in its low nibble, 2j + 1 in its high one; int8
    and the scales as they are; offsets left out where there are none."""
    w4 = _weight("int4g32")
    p = tq.pack_for_triton(w4)
    assert p.q.dtype == torch.uint8 and p.q.shape == (N, K // 2) and p.q.is_contiguous()
    assert torch.equal(p.q & 0xF, w4.q[:, 0::2]) and torch.equal(p.q >> 4, w4.q[:, 1::2])
    assert torch.equal(p.scales, w4.scales) and torch.equal(p.offsets, w4.offsets)
    assert (p.bits, p.group_size, p.in_features, p.out_features) == (4, 32, K, N)
    w8 = _weight("int8")
    p8 = tq.pack_for_triton(w8)
    assert torch.equal(p8.q, w8.q) and p8.offsets is None and p8.group_size == K
    with pytest.raises(ValueError, match="groups of 3"):
        tq.pack_for_triton(QuantizedWeight(4, 3, torch.zeros(2, 6, dtype=torch.uint8),
                                           torch.ones(2, 2)))


def test_supported_formats():
    def fmt(bits: int, group: int, k: int) -> QuantizedWeight:
        dtype = torch.int8 if bits == 8 else torch.uint8
        return QuantizedWeight(bits, group, torch.zeros(1, k, dtype=dtype),
                               torch.ones(1, k // group))

    for bits, group, k in [(8, 16, 64), (4, 32, 64), (4, 128, 256), (8, 96, 96),
                           (4, 96, 96), (8, 384, 768), (8, 97, 97)]:
        assert tq.supports(fmt(bits, group, k)), (bits, group, k)
    for bits, group, k in [(8, 96, 192), (4, 97, 97), (4, 1, 4)]:
        assert not tq.supports(fmt(bits, group, k)), (bits, group, k)


@pytest.mark.parametrize("fmt", ["int8", "int4g32"])
def test_inputs_not_a_multiple_of_the_tile(fmt):
    """160 inputs: the second K tile of 128 holds one group of 32 and masks the rest."""
    k = 160
    gen = torch.Generator().manual_seed(5)
    dense = torch.randn(N, k, generator=gen)
    w = quantize_int8(dense) if fmt == "int8" else quantize_int4(dense, 32)
    for rows in (2, 40):
        x = torch.randn(rows, k, generator=gen)
        _check(tq.triton_quant_linear(x.to(DEVICE), _to(tq.pack_for_triton(w))).cpu(), x, w,
               None)


def test_block_and_split_choice():
    dev = torch.device("cpu")
    assert tq.blocks_for(1) == tq.blocks_for(16) == tq.DECODE_BLOCKS
    assert tq.blocks_for(17)[0] > 16 and tq.blocks_for(4096) == tq.LARGE_BLOCKS
    assert tq.split_k_for(1, 896, 4864, tq.DECODE_BLOCKS, dev) == tq.MAX_SPLIT_K
    assert tq.split_k_for(1, 151936, 4096, tq.DECODE_BLOCKS, dev) == 1
    assert tq.split_k_for(1, 896, 64, tq.DECODE_BLOCKS, dev) == 1  # one K tile
    assert tq.split_k_for(64, 896, 4864, tq.MEDIUM_BLOCKS, dev) == 1


def test_quant_linear_offers_and_runs_the_triton_method(monkeypatch):
    """On CUDA the Triton method comes first, before torch's; a ``QuantLinear`` planned on it
    keeps only its layout and no C++ kernel (here on the interpreter)."""
    monkeypatch.setenv("TIDAL_CPU_KERNELS", "off")  # no C++ kernels built for this
    w = _weight("int4g32", 9)
    cuda = torch.device("cuda")
    assert candidate_methods(w, cuda, torch.bfloat16) == [TRITON, TORCH]
    assert TRITON not in candidate_methods(w, torch.device("cpu"))
    odd = QuantizedWeight(4, 3, torch.zeros(2, 6, dtype=torch.uint8), torch.ones(2, 2))
    assert candidate_methods(odd, cuda, torch.bfloat16) == [TORCH]
    assert METHODS.index(TRITON) < METHODS.index(TORCH)
    bias = torch.randn(N)
    on_device = QuantizedWeight(4, 32, w.q.to(DEVICE), w.scales.to(DEVICE),
                                w.offsets.to(DEVICE))
    layer = QuantLinear(on_device, bias.to(DEVICE), torch.float32, Plan.always(TRITON))
    assert layer.kernel is None and layer.weight_format is None
    assert layer.packs.triton is not None and layer.packs.triton.q.shape == (N, K // 2)
    from bench.model_shapes import weight_bytes  # the roofline's bytes: the packed layout's

    assert weight_bytes(torch.nn.Sequential(layer)) == w.nbytes == N * K // 2 + 2 * N * K // 8
    x = torch.randn(2, 3, K)
    y = layer(x.to(DEVICE)).cpu()
    assert y.shape == (2, 3, N)
    _check(y.view(6, N), x.view(6, K), w, bias)


def _to(p: tq.TritonQuantWeight) -> tq.TritonQuantWeight:
    move = (lambda t: None if t is None else t.to(DEVICE))
    return tq.TritonQuantWeight(p.bits, p.group_size, p.in_features, move(p.q),
                                move(p.scales), move(p.offsets))


def _maybe(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(DEVICE)


# ---------------------------------------------------------------------------------------
def _build(bits: int, group: int, k: int, blocks: tuple, split: int, offsets: bool = True,
           dtype: str = "bf16") -> tuple[dict, dict, dict]:
    """(constexprs, pointer types, launch options) of one compiled variant."""
    block_m, block_n, block_k, num_warps, num_stages = blocks
    constexprs = dict(BITS=bits, GROUP=group, GROUP_PER_TILE=group % block_k == 0 or group == k,
                      HAS_OFFSETS=offsets, HAS_BIAS=True, SPLIT_K=split, BLOCK_M=block_m,
                      BLOCK_N=block_n, BLOCK_K=block_k, PRECISION="tf32", BF16_INTERPRETED=False)
    pointers = dict(x_ptr=f"*{dtype}", q_ptr="*i8" if bits == 8 else "*u8", s_ptr="*fp32",
                    o_ptr="*fp32", bias_ptr=f"*{dtype}",
                    y_ptr=f"*{dtype}" if split == 1 else "*fp32")
    return constexprs, pointers, dict(num_warps=num_warps, num_stages=num_stages)


HOPPER_BUILDS = {
    "decode-int4g32-split": _build(4, 32, 4096, tq.DECODE_BLOCKS, 4),
    "decode-int4g128": _build(4, 128, 4096, tq.DECODE_BLOCKS, 1),
    "decode-int8-channel": _build(8, 4096, 4096, tq.DECODE_BLOCKS, 2, offsets=False),
    "medium-int8g32": _build(8, 32, 4096, tq.MEDIUM_BLOCKS, 1),
    "prefill-int4g64": _build(4, 64, 4096, tq.LARGE_BLOCKS, 1),
    "prefill-int8-channel-fp16": _build(8, 4096, 4096, tq.LARGE_BLOCKS, 1, offsets=False,
                                        dtype="fp16"),
}


def compile_for_hopper() -> None:
    """Compile every ``HOPPER_BUILDS`` variant to an sm_90 cubin (needs compiled kernels:
    ``TRITON_INTERPRET=0``; no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    kernel = tq._quant_linear_kernel
    for build, (constexprs, pointers, options) in HOPPER_BUILDS.items():
        signature = {arg: "constexpr" if arg in constexprs else pointers.get(arg, "i32")
                     for arg in kernel.arg_names}
        source = ASTSource(kernel, signature,
                           {(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
        compiled = compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        assert len(compiled.asm["cubin"]) > 1000, build
        assert compiled.metadata.shared <= 228 * 1024, build
        print(build, "shared", compiled.metadata.shared, "cubin", len(compiled.asm["cubin"]))


@pytest.mark.slow
@pytest.mark.cpu_only(reason="the GPU compiles and runs the kernel itself")
def test_kernel_compiles_for_hopper(tmp_path):
    """The compiled (not interpreted) kernel lowers to sm_90 cubins: Triton's type and shape
    checks and ptxas, with or without a GPU at hand. In a fresh process, since the
    interpreter, once on, is on for the whole process."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path))
    code = ("from tests.unit.gpu.test_triton_quant_linear import compile_for_hopper; "
            "compile_for_hopper()")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("cubin") == len(HOPPER_BUILDS)
