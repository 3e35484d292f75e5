"""Triton kernels over the paged KV cache, and the Python launchers that size their grids.

Three jobs (layout in ``gpu.attention.metadata``):

- ``write_kv`` (``gpu.attention.triton_cache_write``): store a step's keys and values at their
  slots; slot ``-1`` is padding, skipped.
- ``paged_decode``: one query token per request (a decode-only step). A program owns one
  (request, KV head, split): it loads each K/V tile once for all the query heads of its GQA
  group. Long contexts are split over several programs (flash-decoding); each writes a partial
  output and its log-sum-exp, and a second kernel merges them. The number of splits is a launch
  constant while the split length follows each request's ``seq_len`` on the device, so one
  launch (or one captured CUDA graph) serves any context length.
- ``paged_prefill``: variable-length query chunks (prefill, chunked prefill, mixed batches with
  decode rows). A program owns a tile of one request's query tokens for one KV head, with the
  GQA group's heads packed into the tile's rows, and attends causally over everything in the
  request's blocks: prefix-cache hits, earlier chunks and the chunk itself (``write_kv`` has
  already stored it).

Softmax runs in base 2 (``exp2``) with the scale folded into the scores, accumulating in
float32 (with soft-capping, the cap is applied to the plainly scaled scores first).
A layer's attention sinks (``SINKS``: a logit per query head) join each row's denominator once
its keys are done (``_add_sink``); split decode adds them in the merge.
A sliding-window layer's ``window`` (``WINDOWED``) starts each row's keys at its window: decode
splits cover only the window, and a prefill tile starts at its first row's earliest visible
key and masks below each row's.

An int8 cache (``gpu.attention.kv_quant``) is read as int8 and dequantized in registers by its
per-(token, KV head) scales as each tile is loaded (``write_kv``, in ``triton_cache_write``,
quantizes as it stores). Without CUDA, the kernels run in Triton's
interpreter (``TRITON_INTERPRET=1``, set here unless the environment says otherwise), which is
how the CPU tests exercise them.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tidal.gpu.attention.triton_cache_write import (  # noqa: E402
    _last_dim_contiguous,
    check_cache,
    write_kv,
)
from tidal.gpu.attention.triton_sizing import (  # noqa: E402
    MAX_DECODE_SPLITS,
    MIN_DOT,
    decode_num_splits,
    default_block_n,
    dot_precision,
    interpreting,
    needs_upcast,
    scale_pointers,
)

LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------
# the K/V tile both attention kernels read
# --------------------------------------------------------------------------------------
@triton.jit
def _load_kv_tile(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, r, kvh,
                  pos, n_mask, d, d_mask, c_stride_b, c_stride_s, c_stride_h, bt_stride,
                  BLOCK_SIZE: tl.constexpr, UPCAST: tl.constexpr, QUANT: tl.constexpr):
    """K and V ``[BLOCK_N, DIM]`` of KV head ``kvh`` at token positions ``pos`` of request
    ``r``, found through its block table; rows outside ``n_mask`` and padded dims are zero.
    An int8 cache's rows come dequantized to float32 by their scales, which sit at the row's
    offset over head_dim (the scales are laid out as the cache without its last dim)."""
    blk = tl.load(block_table_ptr + r * bt_stride + pos // BLOCK_SIZE, mask=n_mask, other=0)
    off = blk.to(tl.int64) * c_stride_b + (pos % BLOCK_SIZE) * c_stride_s + kvh * c_stride_h
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0)
    v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0)
    if QUANT:
        k_s = tl.load(k_scale_ptr + off // c_stride_h, mask=n_mask, other=0.0)
        v_s = tl.load(v_scale_ptr + off // c_stride_h, mask=n_mask, other=0.0)
        k = k.to(tl.float32) * k_s[:, None]
        v = v.to(tl.float32) * v_s[:, None]
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _soft_cap(s, cap):
    """cap * tanh(s / cap), as (1 - e) / (1 + e) with e = exp(-2 |s / cap|), signed after."""
    t = s / cap
    e = tl.exp(-2.0 * tl.abs(t))
    magnitude = (1.0 - e) / (1.0 + e)
    return tl.where(t < 0, -magnitude, magnitude) * cap


@triton.jit
def _add_sink(acc, l_i, m_i, sinks_ptr, heads, mask):
    """``acc`` and ``l_i`` (rows at the base-2 running max ``m_i``) with each row's head's
    sink logit joined to its denominator, both rescaled to the larger of the two maxima."""
    sink = tl.load(sinks_ptr + heads, mask=mask, other=0.0).to(tl.float32) * 1.4426950408889634
    m_all = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_all)  # 0 for a row that saw no key
    return acc * alpha[:, None], l_i * alpha + tl.exp2(sink - m_all)


# --------------------------------------------------------------------------------------
# decode: split-K paged attention and the merge of the splits
# --------------------------------------------------------------------------------------
@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr,
                   seq_lens_ptr, out_ptr, mid_o_ptr, mid_lse_ptr, sinks_ptr, scale, window,
                   softcap,
                   q_stride_t, q_stride_h, o_stride_t, o_stride_h,
                   c_stride_b, c_stride_s, c_stride_h, bt_stride,
                   mo_stride_r, mo_stride_h, mo_stride_s, ml_stride_r, ml_stride_h,
                   group, head_dim, num_splits,
                   BLOCK_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr,
                   BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr, QUANT: tl.constexpr,
                   WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr):
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + r)
    lo = seq_len * 0  # the first position attended: the window's, where there is one
    if WINDOWED:
        lo = tl.maximum(seq_len - window, 0)
    split_len = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM)
    heads = kvh * group + g
    g_mask = g < group
    d_mask = d < head_dim
    q = tl.load(q_ptr + r * q_stride_t + heads[:, None] * q_stride_h + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < end
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                             block_table_ptr, r, kvh, pos, n_mask, d, d_mask, c_stride_b,
                             c_stride_s, c_stride_h, bt_stride, BLOCK_SIZE, UPCAST, QUANT)
        k, v = k.to(q.dtype), v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if SOFTCAP:  # scale is the plain one here; the scores go to base 2 after the cap
            s = _soft_cap(s, softcap) * 1.4426950408889634
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if SINKS and not SPLIT:  # split outputs get theirs in the merge
        acc, l_i = _add_sink(acc, l_i, m_i, sinks_ptr, heads, g_mask)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    o_mask = g_mask[:, None] & d_mask[None, :]
    if not SPLIT:
        tl.store(out_ptr + r * o_stride_t + heads[:, None] * o_stride_h + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        mo = r * mo_stride_r + heads[:, None] * mo_stride_h + split * mo_stride_s + d[None, :]
        tl.store(mid_o_ptr + mo, o, mask=o_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(mid_lse_ptr + r * ml_stride_r + heads * ml_stride_h + split, lse, mask=g_mask)


@triton.jit
def _merge_splits_kernel(mid_o_ptr, mid_lse_ptr, out_ptr, sinks_ptr,
                         mo_stride_r, mo_stride_h, mo_stride_s, ml_stride_r, ml_stride_h,
                         o_stride_t, o_stride_h, head_dim, num_splits,
                         SPLITS_PAD: tl.constexpr, DIM: tl.constexpr, SINKS: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM)
    s_mask = s < num_splits
    d_mask = d < head_dim
    lse = tl.load(mid_lse_ptr + r * ml_stride_r + h * ml_stride_h + s, mask=s_mask,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    sink = m  # unread without sinks
    if SINKS:  # the head's sink logit, in base 2, is one more term of the denominator
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # 0 for empty splits
    o = tl.load(mid_o_ptr + r * mo_stride_r + h * mo_stride_h + s[:, None] * mo_stride_s
                + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(w, 0)
    if SINKS:
        total += tl.exp2(sink - m)
    res = tl.sum(w[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + r * o_stride_t + h * o_stride_h + d, res.to(out_ptr.dtype.element_ty),
             mask=d_mask)


def paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 max_seq_len: int, out: torch.Tensor | None = None,
                 num_splits: int | None = None, block_n: int | None = None,
                 k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None, window: int = 0,
                 softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of query row ``i`` (``[num_reqs, heads, head_dim]``) over the first
    ``seq_lens[i]`` tokens of request ``i``'s blocks (their last ``window``, where given;
    scores soft-capped by ``softcap``, where given). A request with ``seq_len`` 0 (padding)
    gets zeros. An int8 cache comes with its scales; a layer with attention sinks its
    ``sinks`` ``[heads]``."""
    check_cache(key_cache, value_cache, k_scale, v_scale)
    query = _last_dim_contiguous(query)
    num_reqs, num_heads, head_dim = query.shape[0], query.shape[1], query.shape[2]
    _, block_size, kvh, _ = key_cache.shape
    group = num_heads // kvh
    out = torch.empty_like(query) if out is None else out
    if num_reqs == 0:
        return out
    if num_splits is None:
        attended = min(max_seq_len, window) if window else max_seq_len
        num_splits = decode_num_splits(num_reqs, kvh, attended, query.device)
    block_n = block_n or default_block_n(block_size)
    dim = max(MIN_DOT, triton.next_power_of_2(head_dim))
    if num_splits > 1:
        mid_o = torch.empty(num_reqs, num_heads, num_splits, head_dim, dtype=torch.float32,
                            device=query.device)
        mid_lse = torch.empty(num_reqs, num_heads, num_splits, dtype=torch.float32,
                              device=query.device)
    else:  # unused: the kernel writes the output directly
        mid_o = mid_lse = out
    _decode_kernel[(num_reqs, kvh, num_splits)](
        query, key_cache, value_cache, *scale_pointers(key_cache, k_scale, v_scale), block_table,
        seq_lens, out, mid_o, mid_lse, query if sinks is None else sinks,
        scale if softcap else scale * LOG2E, window, softcap,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        group, head_dim, num_splits,
        BLOCK_SIZE=block_size, GROUP_PAD=max(MIN_DOT, triton.next_power_of_2(group)), DIM=dim,
        BLOCK_N=block_n, SPLIT=num_splits > 1, PRECISION=dot_precision(query),
        UPCAST=needs_upcast(query), QUANT=k_scale is not None, WINDOWED=window > 0,
        SOFTCAP=softcap > 0, SINKS=sinks is not None)
    if num_splits > 1:
        _merge_splits_kernel[(num_reqs, num_heads)](
            mid_o, mid_lse, out, query if sinks is None else sinks,
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
            mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1), head_dim,
            num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits), DIM=dim,
            SINKS=sinks is not None)
    return out


# --------------------------------------------------------------------------------------
# prefill and mixed batches: varlen causal attention over the paged cache
# --------------------------------------------------------------------------------------
@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr,
                    block_table_ptr, seq_lens_ptr, query_start_loc_ptr, sinks_ptr, scale, window,
                    softcap,
                    q_stride_t, q_stride_h, o_stride_t, o_stride_h,
                    c_stride_b, c_stride_s, c_stride_h, bt_stride,
                    group, head_dim,
                    BLOCK_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                    DIM: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                    UPCAST: tl.constexpr, QUANT: tl.constexpr, WINDOWED: tl.constexpr,
                    SOFTCAP: tl.constexpr, SINKS: tl.constexpr):
    r = tl.program_id(0)
    q_tile = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + r)
    q_len = tl.load(query_start_loc_ptr + r + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + r)
    num_cached = seq_len - q_len

    # row i of the tile: query token i // GROUP_PAD, head i % GROUP_PAD of the KV head's group
    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tok = q_tile * BLOCK_Q + rows // GROUP_PAD
    g = rows % GROUP_PAD
    d = tl.arange(0, DIM)
    d_mask = d < head_dim
    row_mask = (tok < q_len) & (g < group)
    heads = kvh * group + g
    q_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + (q_start + tok)[:, None] * q_stride_t + heads[:, None] * q_stride_h
                + d[None, :], mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = num_cached + tok

    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, DIM], tl.float32)
    kv_end = tl.minimum(seq_len, num_cached + (q_tile + 1) * BLOCK_Q)
    kv_start = kv_end * 0
    if WINDOWED:  # from the tile holding the first row's earliest visible key
        kv_start = tl.maximum(num_cached + q_tile * BLOCK_Q - window + 1, 0)
        kv_start = kv_start // BLOCK_N * BLOCK_N
    for n0 in range(kv_start, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < kv_end
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                             block_table_ptr, r, kvh, pos, n_mask, d, d_mask, c_stride_b,
                             c_stride_s, c_stride_h, bt_stride, BLOCK_SIZE, UPCAST, QUANT)
        k, v = k.to(q.dtype), v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if SOFTCAP:  # scale is the plain one here; the scores go to base 2 after the cap
            s = _soft_cap(s, softcap) * 1.4426950408889634
        causal = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        if WINDOWED:
            causal = causal & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(causal, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite without a window: key 0 is visible
        shift = m_new
        if WINDOWED:  # a row may see no key of a tile below its window: shift by 0 there
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - shift)
        p = tl.exp2(s - shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if SINKS:
        acc, l_i = _add_sink(acc, l_i, m_i, sinks_ptr, heads, row_mask)
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (q_start + tok)[:, None] * o_stride_t + heads[:, None] * o_stride_h
             + d[None, :], o.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  block_table: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                  out: torch.Tensor | None = None, block_q: int | None = None,
                  block_n: int | None = None, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None, window: int = 0,
                  softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each request's query rows
    ``query_start_loc[i]:query_start_loc[i+1]`` (its last tokens) over its ``seq_lens[i]``
    cached tokens (within ``window``, where given; scores soft-capped by ``softcap``). Rows
    outside every request are left as they are in ``out``. An int8 cache comes with its
    scales; a layer with attention sinks its ``sinks`` ``[heads]``."""
    check_cache(key_cache, value_cache, k_scale, v_scale)
    query = _last_dim_contiguous(query)
    num_heads, head_dim = query.shape[1], query.shape[2]
    _, block_size, kvh, _ = key_cache.shape
    group = num_heads // kvh
    out = torch.empty_like(query) if out is None else out
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0 or max_query_len == 0:
        return out
    group_pad = triton.next_power_of_2(group)
    if block_q is None:  # about 64 rows per tile (16 at least, for tl.dot)
        block_q = max(1, 64 // group_pad)
    block_q = max(block_q, -(-MIN_DOT // group_pad))
    block_q = min(block_q, max(triton.next_power_of_2(max_query_len), -(-MIN_DOT // group_pad)))
    block_n = block_n or default_block_n(block_size)
    grid = (num_reqs, -(-max_query_len // block_q), kvh)
    _prefill_kernel[grid](
        query, key_cache, value_cache, *scale_pointers(key_cache, k_scale, v_scale), out,
        block_table, seq_lens, query_start_loc, query if sinks is None else sinks,
        scale if softcap else scale * LOG2E, window, softcap,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0),
        group, head_dim,
        BLOCK_SIZE=block_size, GROUP_PAD=group_pad, BLOCK_Q=block_q,
        DIM=max(MIN_DOT, triton.next_power_of_2(head_dim)), BLOCK_N=block_n,
        PRECISION=dot_precision(query), UPCAST=needs_upcast(query), QUANT=k_scale is not None,
        WINDOWED=window > 0, SOFTCAP=softcap > 0, SINKS=sinks is not None)
    return out


__all__ = ["MAX_DECODE_SPLITS", "decode_num_splits", "interpreting", "paged_decode",
           "paged_prefill", "write_kv"]
