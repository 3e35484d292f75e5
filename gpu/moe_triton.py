"""The Triton fused-MoE path for the GPU: the grouped path's computation (``gpu/moe.py``) in two
kernels, with no copy of the tokens' rows and no read of the experts' row counts on the host.

The (token, expert) pairs are sorted by expert and each expert's run is padded to a multiple of
``BLOCK_M`` rows (``align_blocks``, torch ops on the device): the padded length is bounded by
``pairs + E * BLOCK_M`` without reading the counts, so the grid's size is known on the host and
blocks past the last expert's run exit at once. Then:

- ``_gate_up_kernel``: each program one ``[BLOCK_M, BLOCK_N]`` tile of a block's
  ``SiLU(gate) * up``: it loads the block's expert id and its rows' pair ids, gathers those
  tokens' rows of ``x`` tile by tile along K, and accumulates the gate and the up tile in float32
  (rounded to the dtype before the SiLU and the product, as the torch paths round them);
- ``_down_kernel``: each program a tile of the down projection of those rows, scaled by each
  pair's routing weight, stored at the pair's row in token order.

The pairs' outputs are summed per token in torch, as the other paths do. Float32 operands
multiply in IEEE float32 (no TF32).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def align_blocks(ids: torch.Tensor, num_experts: int,
                 block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pair_of_row, expert_of_block)``: for each row of the padded, expert-sorted layout the
    pair it holds (``pairs`` for padding), and for each block of ``block_m`` rows its expert
    (-1 past the last run)."""
    flat = ids.reshape(-1)
    pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount reads its size on the host
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    first_row = padded_end - padded - (torch.cumsum(counts, 0) - counts)  # per expert
    sorted_expert = flat[order]
    rows = first_row[sorted_expert] + torch.arange(pairs, device=ids.device)
    num_blocks = triton.cdiv(pairs, block_m) + num_experts
    pair_of_row = torch.full((num_blocks * block_m,), pairs, dtype=torch.int32,
                             device=ids.device)
    pair_of_row[rows] = order.to(torch.int32)
    block_start = torch.arange(num_blocks, device=ids.device) * block_m
    expert = torch.searchsorted(padded_end, block_start, right=True)
    expert_of_block = torch.where(expert < num_experts, expert, -1).to(torch.int32)
    return pair_of_row, expert_of_block


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b``; ``UPCAST``: half-precision operands in Triton's interpreter, whose dot
    misreads them, taken as their float32 values (exact)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, h_ptr, pair_ptr, expert_ptr, pairs, top_k, K, N,
                    stride_x, stride_we, stride_wn, stride_h,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(expert_ptr + block)
    if expert >= 0:
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pair_ptr + rows)
        valid = pair < pairs
        token = (pair // top_k).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        w = w_ptr + expert.to(tl.int64) * stride_we
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            x = tl.load(x_ptr + token[:, None] * stride_x + k[None, :],
                        mask=valid[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & n_ok[None, :]
            w_gate = tl.load(w + n[None, :] * stride_wn + k[:, None], mask=w_mask, other=0.0)
            w_up = tl.load(w + (n[None, :] + N) * stride_wn + k[:, None], mask=w_mask,
                           other=0.0)
            gate = _dot(x, w_gate, gate, PRECISION, UPCAST)
            up = _dot(x, w_up, up, PRECISION, UPCAST)
        dtype = h_ptr.dtype.element_ty
        g = gate.to(dtype).to(tl.float32)
        silu = (g * tl.sigmoid(g)).to(dtype)
        h = (silu.to(tl.float32) * up.to(dtype).to(tl.float32)).to(dtype)
        tl.store(h_ptr + rows[:, None].to(tl.int64) * stride_h + n[None, :], h,
                 mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, out_ptr, pair_ptr, expert_ptr, scale_ptr, pairs, K, N,
                 stride_h, stride_we, stride_wn, stride_out,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(expert_ptr + block)
    if expert >= 0:
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pair_ptr + rows)
        valid = pair < pairs
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        w = w_ptr + expert.to(tl.int64) * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            h = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + k[None, :],
                        mask=valid[:, None] & k_ok[None, :], other=0.0)
            w_down = tl.load(w + n[None, :] * stride_wn + k[:, None],
                             mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = _dot(h, w_down, acc, PRECISION, UPCAST)
        dtype = out_ptr.dtype.element_ty
        scale = tl.load(scale_ptr + pair, mask=valid, other=0.0)
        y = acc.to(dtype).to(tl.float32) * scale[:, None]
        tl.store(out_ptr + pair[:, None].to(tl.int64) * stride_out + n[None, :], y.to(dtype),
                 mask=valid[:, None] & n_ok[None, :])


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  scales: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[tokens, top_k, H]``: each pair's expert output scaled by ``scales`` (float32, the
    routing weights as the model applies them)."""
    tokens, top_k = ids.shape
    num_experts, two_i, hidden = gate_up.shape
    inter = two_i // 2
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    pair_of_row, expert_of_block = align_blocks(ids, num_experts)
    pairs = tokens * top_k
    h = torch.empty(pair_of_row.numel(), inter, dtype=x.dtype, device=x.device)
    out = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    if pairs == 0:
        return out.view(tokens, top_k, hidden)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    upcast = INTERPRETED and x.dtype != torch.float32
    blocks = expert_of_block.numel()
    _gate_up_kernel[(blocks, triton.cdiv(inter, BLOCK_N))](
        x, gate_up, h, pair_of_row, expert_of_block, pairs, top_k, hidden, inter,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PRECISION=precision, UPCAST=upcast)
    _down_kernel[(blocks, triton.cdiv(hidden, BLOCK_N))](
        h, down, out, pair_of_row, expert_of_block, scales.reshape(-1).float().contiguous(),
        pairs, inter, hidden, h.stride(0), down.stride(0), down.stride(1), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PRECISION=precision, UPCAST=upcast)
    return out.view(tokens, top_k, hidden)
