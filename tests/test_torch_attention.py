"""The CPU attention backend against the plain per-request reference on ragged paged layouts
with GQA: decode rows grouped by context length, prefill chunks over cached context."""

from __future__ import annotations

import random

import pytest
import torch

from gpu.attention.torch_ref import TorchAttentionBackend, reference_paged_attention
from tests.paged_layout import paged_layout, random_caches

KV_HEADS = 2


def _contexts(block_size: int, seed: int) -> list[int]:
    """Lengths at block boundaries, a single token, and random ones up to a few hundred."""
    rng = random.Random(seed)
    fixed = [0, block_size - 1, block_size, block_size + 1, 5 * block_size + 3]
    return fixed + [rng.randint(1, 300) for _ in range(10)]


def _run(context: list[int], query_lens: list[int], block_size: int, head_dim: int,
         group: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    meta = paged_layout(context, query_lens, block_size, seed=len(context) + head_dim)
    key_cache, value_cache = random_caches(meta, block_size, KV_HEADS, head_dim, dtype)
    query = torch.randn(meta.num_actual_tokens, KV_HEADS * group, head_dim).to(dtype)
    got = TorchAttentionBackend().forward(query, key_cache, value_cache, meta, 0.17)
    ref = reference_paged_attention(query.float(), key_cache.float(), value_cache.float(), meta,
                                    0.17)
    return got, ref


@pytest.mark.parametrize("block_size,head_dim,group", [(16, 64, 2), (16, 32, 1), (32, 80, 4)])
def test_decode_rows_of_ragged_lengths_match(block_size, head_dim, group):
    context = _contexts(block_size, seed=block_size + head_dim)
    got, ref = _run(context, [1] * len(context), block_size, head_dim, group, torch.float32)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_mixed_prefill_and_decode_match(dtype, atol):
    """Decode rows beside prefill chunks, some of them over cached context."""
    context = [0, 40, 17, 0, 130, 5]
    query_lens = [9, 1, 20, 1, 1, 33]
    got, ref = _run(context, query_lens, 16, 64, 2, dtype)
    torch.testing.assert_close(got.float(), ref, atol=atol, rtol=0)

