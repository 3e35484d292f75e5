"""How the Triton attention kernels (``gpu/attention/triton_kernels.py``) are sized and fed:
the number of decode splits, the keys per tile, the dot precision, and the scale pointers."""

from __future__ import annotations

import os
from functools import lru_cache

import torch

MAX_DECODE_SPLITS = 32
MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more in merging than it saves
MIN_DOT = 16  # tl.dot wants every dimension >= 16 on the GPU


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_num_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int,
                      device: torch.device) -> int:
    """Enough splits to give every SM about two programs, but none shorter than
    ``MIN_SPLIT_TOKENS`` of the longest context. Depends only on host values, so a CUDA graph
    captured with ``max_seq_len`` = the model's context length serves every shorter one."""
    wanted = -(-2 * _num_sms(device) // max(1, num_reqs * num_kv_heads))
    by_length = -(-max_seq_len // MIN_SPLIT_TOKENS)
    return max(1, min(wanted, by_length, MAX_DECODE_SPLITS))


def default_block_n(block_size: int) -> int:
    """Keys per tile: 64 on the GPU; 16 in the interpreter, where padding costs numpy time."""
    return MIN_DOT if interpreting() else max(64, min(block_size, 128))


def dot_precision(query: torch.Tensor) -> str:
    """float32 keeps full precision (Triton would use TF32); bf16/fp16 ignore the setting."""
    return "ieee" if query.dtype == torch.float32 else "tf32"


def needs_upcast(query: torch.Tensor) -> bool:
    """The interpreter's ``tl.dot`` misreads bfloat16 operands: give it float32 there (the
    query's dtype is the cache's, or the dtype an int8 cache is dequantized to)."""
    return interpreting() and query.dtype == torch.bfloat16


def scale_pointers(cache: torch.Tensor, k_scale: torch.Tensor | None,
            v_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale pointers a kernel takes: an int8 cache's scales, or (unread) the cache."""
    return (k_scale, v_scale) if k_scale is not None and v_scale is not None else (cache, cache)
