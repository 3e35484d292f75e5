"""Attention sinks (gpt-oss: a learned logit per query head that joins each row's softmax
denominator and takes no value) in every attention backend: the torch backend, the CPU backend
and its C++ decode and prefill kernels (float32, bfloat16 and int8 caches, with windows and
soft-caps), and the Triton kernels (in Triton's interpreter without a GPU), against the
per-request reference's plain maths; and that reference against the formula written out for a
one-key context."""

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

KV_HEADS, GROUP, HEAD_DIM, BLOCK = 2, 2, 32, 16
SCALE = 0.3
WINDOWS = [0, 9]  # none, and one shorter than the longer contexts


def _case(context: list[int], query_lens: list[int], device: str = "cpu"):
    meta = paged_layout(context, query_lens, BLOCK, seed=7, device=device)
    key_cache, value_cache = random_caches(meta, BLOCK, KV_HEADS, HEAD_DIM)
    query = 2 * torch.randn(meta.num_actual_tokens, KV_HEADS * GROUP, HEAD_DIM, device=device)
    # logits of the scores' size, so that each sink takes a real share of its row
    sinks = 2 * torch.randn(KV_HEADS * GROUP, device=device)
    return meta, query, key_cache, value_cache, sinks


def _decode_case(device: str = "cpu"):
    context = [0, 3, BLOCK - 1, BLOCK, 2 * BLOCK + 5, 70]
    return _case(context, [1] * len(context), device)


def _prefill_case(device: str = "cpu"):
    """Fresh prompts, chunks over cached context, and a decode row riding along."""
    return _case([0, 0, 30, 7, 50], [3, 40, 17, 1, 26], device)


def _reference(meta, query, key_cache, value_cache, window, sinks) -> torch.Tensor:
    return reference_paged_attention(query, key_cache, value_cache, meta, SCALE, window,
                                     sinks=sinks)


def test_reference_sink_takes_its_share_of_a_one_key_row():
    """With one key, a row's output is that key's value times e^s / (e^s + e^sink)."""
    meta, query, key_cache, value_cache, sinks = _case([0], [1])
    out = _reference(meta, query, key_cache, value_cache, 0, sinks)
    slot = int(meta.slot_mapping[0])
    key = key_cache.view(-1, KV_HEADS, HEAD_DIM)[slot]
    value = value_cache.view(-1, KV_HEADS, HEAD_DIM)[slot]
    for h in range(KV_HEADS * GROUP):
        score = SCALE * torch.dot(query[0, h], key[h // GROUP])
        share = torch.exp(score) / (torch.exp(score) + torch.exp(sinks[h]))
        torch.testing.assert_close(out[0, h], share * value[h // GROUP], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("window", WINDOWS)
def test_cpu_and_torch_backends_with_sinks(backend, window):
    """Through the backends' ``forward``: a mixed step, and a decode-only one."""
    for case in (_prefill_case, _decode_case):
        meta, query, key_cache, value_cache, sinks = case()
        got = get_attention_backend(backend, "cpu").forward(
            query, key_cache, value_cache, meta, SCALE, window=window, sinks=sinks)
        ref = _reference(meta, query, key_cache, value_cache, window, sinks)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (9, 0.0), (0, 3.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "int8"])
def test_cpu_decode_kernel_with_sinks(window, softcap, dtype):
    from tidal.gpu.attention.kv_quant import dequantize, quantize_caches
    from tidal.gpu.cpu.kernels import load_cpu_kernels

    meta, query, key_cache, value_cache, sinks = _decode_case()
    scales: tuple[torch.Tensor, ...] = ()
    ref_keys, ref_values = key_cache, value_cache
    if dtype == "int8":
        key_cache, value_cache, *scales = quantize_caches(key_cache, value_cache)
        ref_keys, ref_values = dequantize(key_cache, scales[0]), dequantize(value_cache, scales[1])
    elif dtype == torch.bfloat16:
        query, key_cache, value_cache = (t.to(dtype) for t in (query, key_cache, value_cache))
        ref_keys, ref_values = key_cache.float(), value_cache.float()
    requests, rows = meta.decode_rows_cpu
    out = torch.full_like(query, float("nan"))
    load_cpu_kernels().decode_attention(out, query, key_cache, value_cache, meta.block_table,
                                        meta.seq_lens, requests, rows, SCALE, *scales,
                                        window=window, softcap=softcap, sinks=sinks)
    ref = reference_paged_attention(query.float(), ref_keys, ref_values, meta, SCALE, window,
                                    softcap, sinks=sinks)
    torch.testing.assert_close(out.float(), ref, atol=1e-4 if dtype == torch.float32 else 2e-2,
                               rtol=0)


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (9, 0.0), (0, 3.0)])
def test_cpu_prefill_kernel_with_sinks(window, softcap):
    from tidal.gpu.cpu.kernels import load_cpu_kernels

    meta, query, key_cache, value_cache, sinks = _prefill_case()
    out = torch.full_like(query, float("nan"))
    load_cpu_kernels().prefill_attention(
        out, query, key_cache, value_cache, meta.block_table, meta.seq_lens,
        meta.query_start_loc, torch.arange(meta.num_reqs), SCALE, window=window,
        softcap=softcap, sinks=sinks)
    ref = reference_paged_attention(query, key_cache, value_cache, meta, SCALE, window, softcap,
                                    sinks=sinks)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


def test_sinks_change_the_result():
    """The yardstick is not blind to sinks: without them the output differs."""
    meta, query, key_cache, value_cache, sinks = _prefill_case()
    with_sinks = _reference(meta, query, key_cache, value_cache, 0, sinks)
    without = _reference(meta, query, key_cache, value_cache, 0, None)
    assert (with_sinks - without).abs().max() > 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("step,num_splits", [("decode", 1), ("decode", 3), ("prefill", None)])
def test_triton_kernels_with_sinks(step, num_splits, window):
    pytest.importorskip("triton")
    from tidal.gpu.attention import triton_kernels as tk

    device = KERNEL_TEST_DEVICE
    case = _decode_case if step == "decode" else _prefill_case
    meta, query, key_cache, value_cache, sinks = case(device)
    if step == "decode":
        got = tk.paged_decode(query, key_cache, value_cache, meta.block_table, meta.seq_lens,
                              SCALE, meta.max_seq_len, num_splits=num_splits, window=window,
                              sinks=sinks)
    else:
        got = tk.paged_prefill(query, key_cache, value_cache, meta.block_table, meta.seq_lens,
                               meta.query_start_loc, SCALE, meta.max_query_len, window=window,
                               sinks=sinks)
    ref = _reference(meta, query, key_cache, value_cache, window, sinks)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
