"""The Triton GEMM of a quantized weight on a GPU: ``y = x W^T + b`` with ``W`` read in its 8 or
4 bits and dequantized in registers, tile by tile, inside the K loop; never a float copy of
the weight in memory.

Layout (``pack_for_triton``, once at load):

- int8: ``q`` as it is, ``[N, K]`` int8, one value per byte;
- 4-bit: ``[N, K / 2]`` uint8, byte ``j`` of a row holding input ``2j`` in its low nibble and
  input ``2j + 1`` in its high one. A K tile of ``BLOCK_K`` inputs is ``BLOCK_K / 2``
  consecutive bytes of each row, read once; its low nibbles multiply the tile's even columns of
  ``x`` and its high nibbles the odd ones (two ``tl.dot`` of half the depth), so the nibbles are
  never interleaved back in registers;
- scales and offsets: ``[N, K / group_size]``, float32 (as ``QuantizedWeight`` keeps them, so
  the kernel's weight is the reference's to the bit) or the activations' dtype
  (``param_dtype``); offsets are left out where the format has none.

Each program owns a ``[BLOCK_M, BLOCK_N]`` tile of ``y``. Per K tile it loads the activations
and the weight's bytes, dequantizes them (``q * scale + offset`` in float32, then rounded to the
activations' dtype, as the ``torch`` method's dequantized weight is) and accumulates ``tl.dot``
in float32. A tile within one group of each row (the group a multiple of ``BLOCK_K``, or one
group per row) loads one scale per row; smaller groups are looked up per element.

Decode (at most ``SMALL_M`` rows) reads the whole weight for a handful of rows, so the time is
the weight's bytes over the bandwidth, and what matters is that enough programs stream it at
once: narrow N tiles, and the K loop split over ``split_k`` programs whose float32 partial
sums are added after. Prefill takes larger tiles and no split.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tidal.gpu.quantization.weights import QuantizedWeight  # noqa: E402

DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # activations the kernel takes
SMALL_M = 16  # rows up to which a call is decode-shaped
MAX_SPLIT_K = 8
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by the row count
DECODE_BLOCKS = (16, 32, 128, 4, 4)
MEDIUM_BLOCKS = (64, 64, 64, 4, 3)
LARGE_BLOCKS = (128, 128, 64, 8, 3)
MAX_BLOCK_K = 128


@dataclass
class TritonQuantWeight:
    """A ``QuantizedWeight`` in the kernel's layout (module docstring)."""

    bits: int
    group_size: int
    in_features: int
    q: torch.Tensor  # int8 [N, K], or uint8 [N, K // 2] for 4 bits
    scales: torch.Tensor  # [N, K // group_size]
    offsets: torch.Tensor | None  # like scales, or None

    @property
    def out_features(self) -> int:
        return self.q.shape[0]


def supports(weight: QuantizedWeight) -> bool:
    """Whether the kernel takes ``weight``'s format: one group per row, or groups of a power of
    two (at least 2 for 4 bits: a byte's pair of inputs in one group) or of a multiple of the
    largest ``BLOCK_K``."""
    g = weight.group_size
    if weight.per_channel:
        return weight.bits == 8 or g % 2 == 0
    return g % MAX_BLOCK_K == 0 or (g & (g - 1) == 0 and (g >= 2 or weight.bits == 8))


def pack_for_triton(weight: QuantizedWeight,
                    param_dtype: torch.dtype = torch.float32) -> TritonQuantWeight:
    """``weight`` in the kernel's layout, scales and offsets in ``param_dtype``."""
    if not supports(weight):
        raise ValueError(f"the kernel takes no {weight.bits}-bit groups of {weight.group_size}")
    q = weight.q
    if weight.bits == 4:
        q = q[:, 0::2] | (q[:, 1::2] << 4)
    params = (None if t is None else t.to(param_dtype).contiguous()
              for t in (weight.scales, weight.offsets))
    return TritonQuantWeight(weight.bits, weight.group_size, weight.shape[1], q.contiguous(),
                             *params)


# ``BF16_INTERPRETED``: bfloat16 in Triton's interpreter, whose ``tl.dot`` misreads bfloat16
# operands and whose float32 -> bfloat16 conversion truncates. There the dot takes the operands'
# float32 values (exact), and conversions round to nearest even on the bits first.
@triton.jit
def _dot(x, w, acc, PRECISION: tl.constexpr, BF16_INTERPRETED: tl.constexpr):
    if BF16_INTERPRETED:
        return tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(x, w, acc, input_precision=PRECISION)


@triton.jit
def _cast(v, dtype: tl.constexpr, BF16_INTERPRETED: tl.constexpr):
    """Float32 ``v`` in ``dtype``, rounded to nearest even."""
    if BF16_INTERPRETED:
        bits = v.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        v = bits.to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def _group_params(ptr, n, n_mask, k0, K, stride_s, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP: tl.constexpr, GROUP_PER_TILE: tl.constexpr):
    """The scales (or offsets) at ``ptr`` of the tile of inputs ``k0 : k0 + BLOCK_K`` held in
    ``ROWS`` rows, float32: ``[1, BLOCK_N]`` where the tile is one group of each output,
    else each of its ``BLOCK_K // GROUP`` groups loaded once and repeated over its rows."""
    if GROUP_PER_TILE:
        at = n * stride_s + k0 // GROUP
        p = tl.load(ptr + at, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    else:
        TILE_GROUPS: tl.constexpr = BLOCK_K // GROUP
        g = k0 // GROUP + tl.arange(0, TILE_GROUPS)
        mask = (g[:, None] * GROUP < K) & n_mask[None, :]
        p = tl.load(ptr + n[None, :] * stride_s + g[:, None], mask=mask, other=0.0)
        p = tl.broadcast_to(p.to(tl.float32)[:, None, :],
                            (TILE_GROUPS, ROWS // TILE_GROUPS, p.shape[1]))
        p = tl.reshape(p, (ROWS, p.shape[2]))
    return p


@triton.jit
def _dequantize(q, s_ptr, o_ptr, n, n_mask, k0, K, stride_s, BLOCK_K: tl.constexpr,
                GROUP: tl.constexpr, GROUP_PER_TILE: tl.constexpr, HAS_OFFSETS: tl.constexpr,
                dtype: tl.constexpr, BF16_INTERPRETED: tl.constexpr):
    """``q`` ``[ROWS, BLOCK_N]``, the tile of inputs ``k0 : k0 + BLOCK_K`` (all of them, or
    the even or odd ones of a 4-bit tile), as weights in ``dtype``."""
    ROWS: tl.constexpr = q.shape[0]
    w = q.to(tl.float32) * _group_params(s_ptr, n, n_mask, k0, K, stride_s, ROWS, BLOCK_K,
                                         GROUP, GROUP_PER_TILE)
    if HAS_OFFSETS:
        w += _group_params(o_ptr, n, n_mask, k0, K, stride_s, ROWS, BLOCK_K, GROUP,
                           GROUP_PER_TILE)
    return _cast(w, dtype, BF16_INTERPRETED)


@triton.jit
def _quant_linear_kernel(x_ptr, q_ptr, s_ptr, o_ptr, bias_ptr, y_ptr, M, N, K,
                         stride_xm, stride_q, stride_s, stride_ym, stride_split,
                         BITS: tl.constexpr, GROUP: tl.constexpr,
                         GROUP_PER_TILE: tl.constexpr, HAS_OFFSETS: tl.constexpr,
                         HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PRECISION: tl.constexpr, BF16_INTERPRETED: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = m < M, n < N
    x_rows = x_ptr + m[:, None].to(tl.int64) * stride_xm
    q_rows = q_ptr + n[None, :].to(tl.int64) * stride_q
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(pid_k, tl.cdiv(K, BLOCK_K), SPLIT_K):
        k0 = kt * BLOCK_K
        if BITS == 8:
            k = k0 + tl.arange(0, BLOCK_K)
            k_mask = k < K
            x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            q = tl.load(q_rows + k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0)
            w = _dequantize(q, s_ptr, o_ptr, n, n_mask, k0, K, stride_s, BLOCK_K, GROUP,
                            GROUP_PER_TILE, HAS_OFFSETS, dtype, BF16_INTERPRETED)
            acc = _dot(x, w, acc, PRECISION, BF16_INTERPRETED)
        else:  # byte j: input 2j (low nibble), 2j + 1 (high nibble)
            j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            k = 2 * j
            k_mask = k < K
            xm = m_mask[:, None] & k_mask[None, :]
            x_even = tl.load(x_rows + k[None, :], mask=xm, other=0.0)
            x_odd = tl.load(x_rows + k[None, :] + 1, mask=xm, other=0.0)
            b = tl.load(q_rows + j[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0)
            w_even = _dequantize(b & 0xF, s_ptr, o_ptr, n, n_mask, k0, K, stride_s, BLOCK_K,
                                 GROUP, GROUP_PER_TILE, HAS_OFFSETS, dtype, BF16_INTERPRETED)
            acc = _dot(x_even, w_even, acc, PRECISION, BF16_INTERPRETED)
            w_odd = _dequantize(b >> 4, s_ptr, o_ptr, n, n_mask, k0, K, stride_s, BLOCK_K,
                                GROUP, GROUP_PER_TILE, HAS_OFFSETS, dtype, BF16_INTERPRETED)
            acc = _dot(x_odd, w_odd, acc, PRECISION, BF16_INTERPRETED)
    out = m[:, None] * stride_ym + n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y = _cast(acc, y_ptr.dtype.element_ty, BF16_INTERPRETED)
        tl.store(y_ptr + out, y, mask=mask)
    else:  # float32 partial sums [SPLIT_K, M, N], added by the caller
        tl.store(y_ptr + pid_k * stride_split + out, acc, mask=mask)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # an H100's, for the interpreter
    return torch.cuda.get_device_properties(device).multi_processor_count


def blocks_for(rows: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for ``rows`` rows of ``x``."""
    if rows <= SMALL_M:
        return DECODE_BLOCKS
    return MEDIUM_BLOCKS if rows <= 64 else LARGE_BLOCKS


def split_k_for(rows: int, n: int, k: int, blocks: tuple[int, ...], device: torch.device
                ) -> int:
    """Decode: enough K splits for about two programs per SM; prefill: none."""
    block_m, block_n, block_k = blocks[:3]
    if rows > SMALL_M:
        return 1
    programs = triton.cdiv(rows, block_m) * triton.cdiv(n, block_n)
    return max(1, min(MAX_SPLIT_K, triton.cdiv(k, block_k), 2 * _sm_count(device) // programs))


def triton_quant_linear(x: torch.Tensor, weight: TritonQuantWeight,
                        bias: torch.Tensor | None = None, *,
                        blocks: tuple[int, int, int, int, int] | None = None,
                        split_k: int | None = None) -> torch.Tensor:
    """``x W^T + bias`` for ``x`` ``[M, K]`` (float16, bfloat16 or float32; its dtype is the
    result's). ``blocks`` and ``split_k`` override the row count's choice (tests)."""
    if x.dtype not in DTYPES:
        raise ValueError(f"activations must be one of {DTYPES}; got {x.dtype}")
    rows, k = x.shape
    if k != weight.in_features:
        raise ValueError(f"x has {k} inputs; the weight takes {weight.in_features}")
    if x.stride(1) != 1:
        x = x.contiguous()
    n = weight.out_features
    blocks = blocks or blocks_for(rows)
    block_m, block_n, block_k, num_warps, num_stages = blocks
    split = split_k or split_k_for(rows, n, k, blocks, x.device)
    if split == 1:
        y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    else:
        y = torch.empty(split, rows, n, dtype=torch.float32, device=x.device)
    group = weight.group_size
    grid = (triton.cdiv(rows, block_m), triton.cdiv(n, block_n), split)
    _quant_linear_kernel[grid](
        x, weight.q, weight.scales,
        weight.offsets if weight.offsets is not None else weight.scales,
        bias if bias is not None else x, y, rows, n, k,
        x.stride(0), weight.q.stride(0), weight.scales.stride(0), n, rows * n,
        BITS=weight.bits, GROUP=group,
        GROUP_PER_TILE=group % block_k == 0 or group == k,
        HAS_OFFSETS=weight.offsets is not None, HAS_BIAS=bias is not None, SPLIT_K=split,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BF16_INTERPRETED=_interpreting() and x.dtype == torch.bfloat16,
        num_warps=num_warps, num_stages=num_stages)
    if split == 1:
        return y
    y = y.sum(0)
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
