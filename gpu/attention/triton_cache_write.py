"""The Triton cache write: a step's keys and values stored at their slots (slot ``-1`` is
padding, skipped), into a float cache as they are, or into an int8 one quantized per head
vector with its scale beside it (``gpu.attention.kv_quant``: max |x| / 127, rounded to the
nearest, ties away from zero here where the torch reference rounds them to even; a tie needs
an element at exactly half a step, and then the two differ by one step of that element).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INV_127 = tl.constexpr(1.0 / 127.0)  # float32(1 / 127) in the kernel, as the reference


@triton.jit
def _store_quantized(x, cache_ptr, scale_ptr, dst, scale_dst, mask, h_mask):
    """x ``[HEADS, DIM]`` as int8 at ``dst`` and its per-head scales at ``scale_dst``."""
    xf = x.to(tl.float32)
    scale = tl.max(tl.abs(xf), 1) * INV_127
    divisor = tl.where(scale > 0.0, scale, 1.0)
    y = xf / divisor[:, None]
    y = tl.where(y >= 0.0, tl.floor(y + 0.5), tl.ceil(y - 0.5))
    y = tl.minimum(tl.maximum(y, -127.0), 127.0)
    tl.store(cache_ptr + dst, y.to(tl.int8), mask=mask)
    tl.store(scale_ptr + scale_dst, scale, mask=h_mask)


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
                     k_scale_ptr, v_scale_ptr,
                     k_stride_t, k_stride_h, v_stride_t, v_stride_h, c_stride_slot, c_stride_h,
                     num_kv_heads, head_dim,
                     HEADS: tl.constexpr, DIM: tl.constexpr, QUANT: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, HEADS)[:, None]
    d = tl.arange(0, DIM)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    dst = slot * c_stride_slot + h * c_stride_h + d
    k = tl.load(key_ptr + t * k_stride_t + h * k_stride_h + d, mask=mask, other=0.0)
    v = tl.load(value_ptr + t * v_stride_t + v_stride_h * h + d, mask=mask, other=0.0)
    if QUANT:
        heads = tl.arange(0, HEADS)
        scale_dst = slot * num_kv_heads + heads
        h_mask = heads < num_kv_heads
        _store_quantized(k, key_cache_ptr, k_scale_ptr, dst, scale_dst, mask, h_mask)
        _store_quantized(v, value_cache_ptr, v_scale_ptr, dst, scale_dst, mask, h_mask)
    else:
        tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Store ``key``/``value`` ``[tokens, kv_heads, head_dim]`` (rows past
    ``len(slot_mapping)`` ignored) at their slots of the ``[blocks, block_size, kv_heads,
    head_dim]`` caches; an int8 cache's scales ``[blocks, block_size, kv_heads]`` with it."""
    check_cache(key_cache, value_cache, k_scale, v_scale)
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _, _, kvh, dim = key_cache.shape
    quant = k_scale is not None
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        k_scale if quant else key_cache, v_scale if quant else value_cache,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(1), key_cache.stride(2), kvh, dim,
        HEADS=triton.next_power_of_2(kvh), DIM=triton.next_power_of_2(dim), QUANT=quant)


def check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """The caches the kernels take: contiguous, of one shape; int8 ones with scales."""
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("the KV caches must be contiguous "
                         "[num_blocks, block_size, num_kv_heads, head_dim] tensors")
    if key_cache.shape != value_cache.shape:
        raise ValueError(f"key and value caches differ in shape: {tuple(key_cache.shape)} "
                         f"vs {tuple(value_cache.shape)}")
    quant = key_cache.dtype == torch.int8
    for s in (k_scale, v_scale):
        if (s is not None) != quant:
            raise ValueError("an int8 cache needs its scales, and only an int8 cache has them")
        if s is not None and (s.shape != key_cache.shape[:3] or s.dtype != torch.float32
                              or not s.is_contiguous()):
            raise ValueError("scales must be contiguous float32 "
                             "[num_blocks, block_size, num_kv_heads] tensors")


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
