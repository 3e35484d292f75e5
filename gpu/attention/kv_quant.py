"""The KV cache in 8 bits: int8 values with one float32 scale per (token, KV head).

A layer's cache is then four tensors: the int8 keys and values ``[num_blocks, block_size,
num_kv_heads, head_dim]`` beside their scales ``[num_blocks, block_size, num_kv_heads]``, paged
the same way, so prefix caching, preemption and chunked prefill, which deal in block ids, see no
difference. Each head vector is quantized symmetrically when its token is written: its scale is
its largest magnitude over 127, and its values are rounded to the nearest int8 (ties to even).
A scale per head vector keeps an outlier head from costing the others their resolution, and a
scale per token lets the cache be written token by token, with nothing to recompute later. The
attention kernels read the int8 values and their scales and dequantize in registers.

This module holds the torch statement of that format, which the torch backend runs and the
kernels are tested against.
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0
# The scale is max |x| times float32(1 / 127), a multiply where a division would do, as the
# C++ and Triton writes compute it: their results equal this reference's to the bit.
INV_INT8_MAX = 1.0 / INT8_MAX
SCALE_DTYPE = torch.float32
SCALE_BYTES = 4  # one float32 per (token, KV head), for the key and the value each


def is_quantized(kv_cache_dtype: str) -> bool:
    """Whether the cache holds 8-bit values with scales beside them."""
    return kv_cache_dtype == "int8"


def quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., head_dim]`` -> int8 values of the same shape and float32 scales ``[...]``:
    scale = max |x| / 127 per head vector, value = round(x / scale). An all-zero vector gets
    scale 0 and zeros."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) * INV_INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (xf / safe[..., None]).round().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize(cache: torch.Tensor, scale: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 ``cache`` ``[..., head_dim]`` times its ``scale`` ``[...]``, in ``dtype``."""
    return (cache.float() * scale[..., None]).to(dtype)


def write_quantized(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Quantize ``key``/``value`` ``[tokens, kv_heads, head_dim]`` and store them and their
    scales at their slots (rows past ``len(slot_mapping)`` ignored; slot -1 skipped)."""
    n = slot_mapping.shape[0]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid] if not bool(valid.all()) else slot_mapping
    for x, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        q, s = quantize_heads(x[:n][valid])
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, q)
        scale.view(-1, scale.shape[-1]).index_copy_(0, slots, s)


def allocate_layer(shape: tuple[int, int, int, int], dtype: torch.dtype,
                   device: str | torch.device) -> tuple[torch.Tensor, ...]:
    """One layer's cache of ``shape`` ``[num_blocks, block_size, num_kv_heads, head_dim]``,
    zeroed: (keys, values), and for int8 their scales after them."""
    caches = (torch.zeros(shape, dtype=dtype, device=device),
              torch.zeros(shape, dtype=dtype, device=device))
    if dtype != torch.int8:
        return caches
    return caches + (torch.zeros(shape[:3], dtype=SCALE_DTYPE, device=device),
                     torch.zeros(shape[:3], dtype=SCALE_DTYPE, device=device))


def quantize_caches(key_cache: torch.Tensor,
                    value_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Float caches as an int8 cache's four tensors, for tests and benchmarks."""
    (k, ks), (v, vs) = quantize_heads(key_cache), quantize_heads(value_cache)
    return k, v, ks, vs
