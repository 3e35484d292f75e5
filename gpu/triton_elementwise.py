"""The element-wise steps of a decoder layer as one Triton kernel each, for the GPU: RMSNorm
(with the residual add before it), SiLU·up, and rotary embeddings on q and k in place.

Torch's forms of these are chains of 2 to 14 kernels (casts, reductions, products, an index
and a cat), each a launch and a trip through memory. These take the same arguments as the CPU
kernels (``gpu/cpu/csrc``) and round as the torch forms do (``gpu/layers.py``): each torch op's
result is rounded to the input dtype where torch rounds it, so a bfloat16 model gives the same
values down to the order of a float32 sum. Unlike the CPU kernels they take strided views
(the q and k of a fused qkv projection) and int32 or int64 positions.

Without CUDA they run in Triton's interpreter (``TRITON_INTERPRET=1``), which is how the CPU
tests check them against the torch forms.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# The CPU kernels take contiguous rows and int64 positions; these take any view whose last
# dimension is contiguous, and either index dtype (``gpu.layers`` reads this).
TAKES_VIEWS = True
MAX_ROW = 1 << 16  # elements a norm row may have: one program holds a whole row


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """``x`` as rows of its last dimension: (rows, rows per outer index, outer stride, inner
    stride), for a 1-D, 2-D or 3-D tensor whose last dimension is contiguous."""
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        raise ValueError("the last dimension must be contiguous")
    if x.dim() == 1:
        return 1, 1, 0, 0
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    if x.dim() == 3:
        return x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)
    raise ValueError(f"expected 1 to 3 dimensions, got {x.dim()}")


def _row_warps(block: int) -> int:
    return max(1, min(16, block // 256))


@triton.jit
def _row_offset(row, per_outer, outer_stride, inner_stride):
    return (row // per_outer).to(tl.int64) * outer_stride + (row % per_outer) * inner_stride


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, sum_ptr, out_ptr, w_ptr, n_cols, eps,
                     per_outer, x_outer, x_inner, d_outer, d_inner, s_outer, s_inner,
                     o_outer, o_inner, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    """One row: (with ``HAS_DELTA``) ``s = x + delta`` rounded to x's dtype and stored, then
    ``w * round(s * rsqrt(mean(s²) + eps))`` in float32, rounded to the output's dtype."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + _row_offset(row, per_outer, x_outer, x_inner) + cols, mask=mask,
                other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + _row_offset(row, per_outer, d_outer, d_inner) + cols,
                    mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + _row_offset(row, per_outer, s_outer, s_inner) + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * inv).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + _row_offset(row, per_outer, o_outer, o_inner) + cols
    tl.store(out_ptrs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    if n > MAX_ROW:
        raise ValueError(f"rows of {n} elements are longer than {MAX_ROW}")
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype),
                      device=x.device)
    total = torch.empty_like(x, memory_format=torch.contiguous_format) if delta is not None \
        else x
    rows, per_outer, x_outer, x_inner = _rows(x)
    d = delta if delta is not None else x
    _, _, d_outer, d_inner = _rows(d)
    _, _, s_outer, s_inner = _rows(total)
    _, _, o_outer, o_inner = _rows(out)
    if rows:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows,)](x, d, total, out, weight, n, eps, per_outer, x_outer,
                                  x_inner, d_outer, d_inner, s_outer, s_inner, o_outer,
                                  o_inner, HAS_DELTA=delta is not None, BLOCK=block,
                                  num_warps=_row_warps(block))
    return total, out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of ``x`` (1-D to 3-D, last dimension contiguous)."""
    return _norm(x, None, weight, eps)[1]


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, rms_norm(x + delta))`` in one pass over the rows."""
    if delta.shape != x.shape or delta.dtype != x.dtype:
        raise ValueError(f"delta {tuple(delta.shape)} {delta.dtype} does not match x "
                         f"{tuple(x.shape)} {x.dtype}")
    return _norm(x, delta, weight, eps)


@triton.jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, n, in_stride, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    base = gu_ptr + row.to(tl.int64) * in_stride
    gate = tl.load(base + cols, mask=mask, other=0.0)
    up = tl.load(base + n + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # F.silu rounds to the input dtype
    out = (silu.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row.to(tl.int64) * out_stride + cols, out, mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``SiLU(gate) * up`` of each row of a fused ``[rows, 2n]`` gate/up projection."""
    if gate_up.dim() != 2 or gate_up.stride(-1) != 1 or gate_up.shape[-1] % 2:
        raise ValueError("gate_up must be [rows, 2n] with contiguous rows")
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(n))
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](
            gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block,
            num_warps=4)
    return out


@triton.jit
def _rotate(base, heads, cos, sin, head_stride, half, BLOCK_D: tl.constexpr,
            BLOCK_H: tl.constexpr):
    """Rotate ``heads`` heads at ``base`` in place: the first half ``x1`` becomes
    ``x1·cos - x2·sin`` and the second ``x2·cos + x1·sin``, each product and sum rounded to
    the tensor's dtype as torch's ``q * cos + rotate_half(q) * sin`` rounds them."""
    h = tl.arange(0, BLOCK_H)[:, None]
    c = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < heads) & (c < half)
    ptrs = base + h * head_stride + c
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + half, mask=mask, other=0.0)
    dtype = x1.dtype
    cos = cos.to(dtype).to(tl.float32)
    sin = sin.to(dtype).to(tl.float32)
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    out1 = (a1 * cos).to(dtype).to(tl.float32) + (-a2 * sin).to(dtype).to(tl.float32)
    out2 = (a2 * cos).to(dtype).to(tl.float32) + (a1 * sin).to(dtype).to(tl.float32)
    tl.store(ptrs, out1.to(dtype), mask=mask)
    tl.store(ptrs + half, out2.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr, q_heads, k_heads, q_token_stride,
                   q_head_stride, k_token_stride, k_head_stride, table_stride, half,
                   BLOCK_D: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr):
    """One token: every q and k head rotated by the angles of the token's position (the
    table's halves are equal: its rows are ``cat(freqs, freqs)``)."""
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    c = tl.arange(0, BLOCK_D)[None, :]
    cos = tl.load(cos_ptr + pos * table_stride + c, mask=c < half, other=0.0)
    sin = tl.load(sin_ptr + pos * table_stride + c, mask=c < half, other=0.0)
    _rotate(q_ptr + token * q_token_stride, q_heads, cos, sin, q_head_stride, half, BLOCK_D,
            BLOCK_QH)
    _rotate(k_ptr + token * k_token_stride, k_heads, cos, sin, k_head_stride, half, BLOCK_D,
            BLOCK_KH)


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     positions: torch.Tensor) -> None:
    """Rotate ``q`` ``[tokens, heads, head_dim]`` and ``k`` ``[tokens, kv_heads, head_dim]``
    in place by the rows of the float32 ``cos``/``sin`` tables at ``positions``."""
    head_dim = q.shape[-1]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1:
        raise ValueError("q, k and the tables must have a contiguous last dimension")
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} must be even")
    tokens = q.shape[0]
    if tokens:
        _rotary_kernel[(tokens,)](
            q, k, cos, sin, positions, q.shape[1], k.shape[1], q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), cos.stride(0), head_dim // 2,
            BLOCK_D=triton.next_power_of_2(head_dim // 2),
            BLOCK_QH=triton.next_power_of_2(q.shape[1]),
            BLOCK_KH=triton.next_power_of_2(k.shape[1]), num_warps=4)
