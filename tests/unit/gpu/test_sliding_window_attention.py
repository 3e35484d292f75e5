"""Sliding-window attention and logit soft-capping (Gemma 2/3) in every attention backend: the
C++ decode and prefill kernels, the Triton kernels (in Triton's interpreter without a GPU) and
the torch backend, against the per-request reference's plain maths."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.device import KERNEL_TEST_DEVICE  # noqa: E402
from tidal.gpu.attention import get_attention_backend  # noqa: E402
from tidal.gpu.attention.paged_layout import paged_layout, random_caches  # noqa: E402
from tidal.gpu.attention.torch_ref import reference_paged_attention  # noqa: E402
from tidal.gpu.cpu.kernels import load_cpu_kernels  # noqa: E402

KV_HEADS = 2
SCALE = 0.3
# (window, softcap): a window shorter than a block, one across blocks, none with a cap
SETTINGS = [(5, 0.0), (21, 0.0), (9, 4.0), (0, 4.0)]


def _case(context: list[int], query_lens: list[int], block_size: int, head_dim: int,
          group: int, device: str = "cpu"):
    meta = paged_layout(context, query_lens, block_size, seed=head_dim + group, device=device)
    key_cache, value_cache = random_caches(meta, block_size, KV_HEADS, head_dim)
    # scores of several units, so that a cap of 4 bends them
    query = 4 * torch.randn(meta.num_actual_tokens, KV_HEADS * group, head_dim, device=device)
    return meta, query, key_cache, value_cache


def _reference(meta, query, key_cache, value_cache, window, softcap) -> torch.Tensor:
    return reference_paged_attention(query, key_cache, value_cache, meta, SCALE, window,
                                     softcap)


def _decode_case(block_size: int, head_dim: int, group: int, device: str = "cpu"):
    context = [0, 3, block_size - 1, block_size, 2 * block_size + 5, 70]
    return _case(context, [1] * len(context), block_size, head_dim, group, device)


def _prefill_case(block_size: int, head_dim: int, group: int, device: str = "cpu"):
    """Fresh prompts, chunks over cached context, and a decode row riding along."""
    return _case([0, 0, 30, 7, 50], [3, 40, 17, 1, 26], block_size, head_dim, group, device)


@pytest.mark.parametrize("window,softcap", SETTINGS)
@pytest.mark.parametrize("block_size,head_dim,group", [(16, 32, 2), (8, 256, 3)])
def test_cpu_decode_kernel_windows_and_caps(window, softcap, block_size, head_dim, group):
    meta, query, key_cache, value_cache = _decode_case(block_size, head_dim, group)
    requests, rows = meta.decode_rows_cpu
    out = torch.full_like(query, float("nan"))
    load_cpu_kernels().decode_attention(out, query, key_cache, value_cache, meta.block_table,
                                        meta.seq_lens, requests, rows, SCALE, window=window,
                                        softcap=softcap)
    ref = _reference(meta, query, key_cache, value_cache, window, softcap)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("window,softcap", SETTINGS)
@pytest.mark.parametrize("block_size,head_dim,group", [(16, 32, 2), (8, 256, 3)])
def test_cpu_prefill_kernel_windows_and_caps(window, softcap, block_size, head_dim, group):
    meta, query, key_cache, value_cache = _prefill_case(block_size, head_dim, group)
    out = torch.full_like(query, float("nan"))
    load_cpu_kernels().prefill_attention(
        out, query, key_cache, value_cache, meta.block_table, meta.seq_lens,
        meta.query_start_loc, torch.arange(meta.num_reqs), SCALE, window=window,
        softcap=softcap)
    ref = _reference(meta, query, key_cache, value_cache, window, softcap)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("window,softcap", SETTINGS)
def test_cpu_and_torch_backends_window_and_cap(backend, window, softcap):
    """Through the backends' ``forward``, a mixed step of prefill chunks and decode rows."""
    meta, query, key_cache, value_cache = _prefill_case(16, 32, 2)
    got = get_attention_backend(backend, "cpu").forward(
        query, key_cache, value_cache, meta, SCALE, window=window, softcap=softcap)
    ref = _reference(meta, query, key_cache, value_cache, window, softcap)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("window,softcap", SETTINGS)
@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_triton_kernels_window_and_cap(step, window, softcap):
    pytest.importorskip("triton")
    from tidal.gpu.attention import triton_kernels as tk

    device = KERNEL_TEST_DEVICE
    case = _decode_case if step == "decode" else _prefill_case
    meta, query, key_cache, value_cache = case(16, 32, 2, device)
    if step == "decode":
        got = tk.paged_decode(query, key_cache, value_cache, meta.block_table, meta.seq_lens,
                              SCALE, meta.max_seq_len, num_splits=3, window=window,
                              softcap=softcap)
    else:
        got = tk.paged_prefill(query, key_cache, value_cache, meta.block_table, meta.seq_lens,
                               meta.query_start_loc, SCALE, meta.max_query_len, window=window,
                               softcap=softcap)
    ref = _reference(meta, query, key_cache, value_cache, window, softcap)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
