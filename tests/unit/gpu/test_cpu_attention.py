"""The CPU attention backends (C++ decode kernels, and plain torch) against the per-request
reference on ragged paged layouts with GQA: decode rows of many lengths, prefill chunks over
cached context."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from tidal.gpu.attention import AttentionBackend, get_attention_backend
from tidal.gpu.attention.cpu_backend import CpuAttentionBackend
from tidal.gpu.attention.paged_layout import paged_layout, random_caches
from tidal.gpu.attention.torch_ref import TorchAttentionBackend, reference_paged_attention
from tidal.gpu.cpu.kernels import load_cpu_kernels

KV_HEADS = 2


def test_cpu_default_is_the_compiled_kernels():
    """The kernels build here (CI has a compiler): a failed build must not pass unseen."""
    assert load_cpu_kernels() is not None
    assert isinstance(get_attention_backend("auto", "cpu"), CpuAttentionBackend)


@pytest.fixture(params=["cpu", "torch"])
def backend(request) -> AttentionBackend:
    return get_attention_backend(request.param, "cpu")


def _contexts(block_size: int, seed: int) -> list[int]:
    """Lengths at block boundaries, a single token, and random ones up to a few hundred."""
    rng = random.Random(seed)
    fixed = [0, block_size - 1, block_size, block_size + 1, 5 * block_size + 3]
    return fixed + [rng.randint(1, 300) for _ in range(10)]


def _run(backend: AttentionBackend, context: list[int], query_lens: list[int],
         block_size: int, head_dim: int, group: int,
         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    meta = paged_layout(context, query_lens, block_size, seed=len(context) + head_dim)
    key_cache, value_cache = random_caches(meta, block_size, KV_HEADS, head_dim, dtype)
    query = torch.randn(meta.num_actual_tokens, KV_HEADS * group, head_dim).to(dtype)
    got = backend.forward(query, key_cache, value_cache, meta, 0.17)
    ref = reference_paged_attention(query.float(), key_cache.float(), value_cache.float(), meta,
                                    0.17)
    return got, ref


# head_dim 40 has no compiled kernel: the cpu backend hands those rows to the torch path. The
# kernel's block is one vector of positions (16 with AVX-512, 8 with AVX2), and a head too wide
# for the registers is taken in slices (256 with AVX-512; every size above 32 with AVX2).
@pytest.mark.parametrize("block_size,head_dim,group",
                         [(16, 64, 2), (16, 32, 1), (32, 80, 4), (8, 128, 8), (16, 40, 2),
                          (16, 96, 3), (16, 256, 2)])
def test_decode_rows_of_ragged_lengths_match(backend, block_size, head_dim, group):
    context = _contexts(block_size, seed=block_size + head_dim)
    got, ref = _run(backend, context, [1] * len(context), block_size, head_dim, group,
                    torch.float32)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("head_dim,group", [(32, 1), (64, 2), (80, 4), (96, 2), (128, 8),
                                            (256, 1)])
def test_bfloat16_decode_rows_match(backend, head_dim, group):
    """bfloat16 caches: the kernel reads head sizes divisible by two vectors as even/odd pairs
    (32 floats with AVX-512, where 80 is not; 16 with AVX2), so every element must come back to
    its place; it computes in float32, so its only error is the output's rounding. The torch
    path's attention runs in bfloat16 itself."""
    torch.manual_seed(head_dim)
    context = _contexts(16, seed=head_dim)
    got, ref = _run(backend, context, [1] * len(context), 16, head_dim, group, torch.bfloat16)
    atol = 8e-3 if isinstance(backend, CpuAttentionBackend) else 3e-2
    torch.testing.assert_close(got.float(), ref.to(torch.bfloat16).float(), atol=atol, rtol=0)


@pytest.fixture
def threads():
    """Sets torch's thread count for a test, and puts it back after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


# Fewer decode rows than threads: the kernel splits each row's KV heads over the threads,
# unevenly where they do not divide (3 heads in 2 parts).
@pytest.mark.parametrize("kv_heads,num_threads,rows", [(2, 2, 1), (3, 2, 1), (4, 8, 3),
                                                       (8, 4, 2)])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 8e-3)])
def test_fewer_rows_than_threads_split_their_kv_heads(threads, kv_heads, num_threads, rows,
                                                      dtype, atol):
    threads(num_threads)
    context = random.Random(kv_heads + rows).sample(range(1, 300), rows)
    meta = paged_layout(context, [1] * rows, 16, seed=kv_heads)
    key_cache, value_cache = random_caches(meta, 16, kv_heads, 64, dtype)
    query = torch.randn(rows, kv_heads * 2, 64).to(dtype)
    got = get_attention_backend("cpu", "cpu").forward(query, key_cache, value_cache, meta, 0.17)
    ref = reference_paged_attention(query.float(), key_cache.float(), value_cache.float(), meta,
                                    0.17)
    torch.testing.assert_close(got.float(), ref.to(dtype).float(), atol=atol, rtol=0)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2),
                                        (torch.float16, 5e-3)])
def test_mixed_prefill_and_decode_match(backend, dtype, atol):
    """Decode rows beside prefill chunks, some of them over cached context."""
    context = [0, 40, 17, 0, 130, 5]
    query_lens = [9, 1, 20, 1, 1, 33]
    got, ref = _run(backend, context, query_lens, 16, 64, 2, dtype)
    torch.testing.assert_close(got.float(), ref, atol=atol, rtol=0)


def test_decode_kernel_rejects_bad_inputs_instead_of_reading_past_them():
    kernels = load_cpu_kernels()
    meta = paged_layout([5, 20], [1, 1], 16, seed=0)  # lengths 6 and 21: 1 and 2 blocks
    key_cache, value_cache = random_caches(meta, 16, KV_HEADS, 64)
    query = torch.randn(2, 4, 64)

    def attend(query=query, requests=(0, 1), table=meta.block_table, lens=meta.seq_lens):
        out = torch.full_like(query, float("nan"))
        kernels.decode_attention(out, query, key_cache, value_cache, table, lens,
                                 torch.tensor(requests), torch.tensor([0, 1]), 1.0)
        return out

    assert torch.isfinite(attend()).all()  # the valid call, for contrast
    with pytest.raises(RuntimeError, match="head_dim"):
        attend(query=torch.randn(2, 4, 32))
    with pytest.raises(RuntimeError, match="request 7 out of range"):
        attend(requests=(0, 7))
    _rejects_contexts_past_their_blocks(meta, lambda lens, table: attend(lens=lens, table=table))
    with pytest.raises(RuntimeError, match="cache's dtype"):
        attend(query=query.double())


def _rejects_contexts_past_their_blocks(meta, attend) -> None:
    """``attend(seq_lens, block_table)`` for two requests, the second over two blocks: a length
    past the table's row, then a block past the cache."""
    with pytest.raises(RuntimeError, match="exceeds the block table"):
        attend(torch.tensor([6, 10**4], dtype=torch.int32), meta.block_table)
    bad_table = meta.block_table.clone()
    bad_table[1, 1] = 10**6
    with pytest.raises(RuntimeError, match="block 1000000 out of range"):
        attend(meta.seq_lens, bad_table)


def test_backend_names_are_checked():
    assert isinstance(get_attention_backend("torch", "cpu"), TorchAttentionBackend)
    with pytest.raises(ValueError, match="'cpu', 'torch', 'triton'"):
        get_attention_backend("flash", "cpu")


def test_kernels_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("TIDAL_NO_CPU_KERNELS", "1")
    assert load_cpu_kernels() is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_cache_write_matches_the_torch_write(dtype):
    """Rows strided as views into a fused projection; a padded row (slot -1) is skipped."""
    meta = paged_layout([3, 20], [4, 1], 16, seed=3, pad_rows=2)
    base = random_caches(meta, 16, KV_HEADS, 32, dtype)
    caches = [tuple(c.clone() for c in base) for _ in range(2)]
    fused = torch.randn(7, 3 * KV_HEADS * 32).to(dtype)
    key = fused[:, :KV_HEADS * 32].view(7, KV_HEADS, 32)
    value = fused[:, KV_HEADS * 32: 2 * KV_HEADS * 32].view(7, KV_HEADS, 32)
    get_attention_backend("cpu", "cpu").write_kv(key, value, *caches[0], meta.slot_mapping)
    TorchAttentionBackend().write_kv(key, value, *caches[1], meta.slot_mapping)
    assert meta.slot_mapping.tolist()[-2:] == [-1, -1]
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    slot = int(meta.slot_mapping[0])
    assert torch.equal(caches[0][0].flatten(0, 1)[slot], key[0])  # really written
    assert not torch.equal(base[0].flatten(0, 1)[slot], key[0])


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2),
                                        (torch.float16, 5e-3)])
def test_decode_kernel_softmax_survives_a_first_block_of_minus_inf_scores(dtype, atol):
    """Request 0's first 16 positions score -inf (a -inf key feature against a positive query
    one): they weigh 0, and the later positions still count. Request 1 scores -inf everywhere:
    0 / 0, NaN, as torch's softmax gives."""
    meta = paged_layout([39, 20], [1, 1], 16, seed=5)
    key_cache, value_cache = random_caches(meta, 16, KV_HEADS, 64, dtype)
    key_cache[meta.block_table[0, 0], :, :, 0] = float("-inf")
    key_cache[meta.block_table[1, :2], :, :, 0] = float("-inf")
    query = torch.randn(2, 2 * KV_HEADS, 64).to(dtype)
    query[..., 0] = 1.0
    out = torch.empty_like(query)
    load_cpu_kernels().decode_attention(out, query, key_cache, value_cache, meta.block_table,
                                        meta.seq_lens, torch.tensor([0, 1]),
                                        torch.tensor([0, 1]), 0.17)
    ref = reference_paged_attention(query.float(), key_cache.float(), value_cache.float(), meta,
                                    0.17)
    assert torch.isfinite(ref[0]).all() and torch.isnan(ref[1]).all()
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=0, equal_nan=True)


def test_decode_kernel_rejects_overlapping_outputs_and_empty_kv_heads():
    """Rows are written by parallel threads: out rows sharing memory (with each other, with
    another query row, with the caches) would race. No KV heads must raise, not divide by 0."""
    kernels = load_cpu_kernels()
    meta = paged_layout([5, 20, 9], [1, 1, 1], 16, seed=1)
    key_cache, value_cache = random_caches(meta, 16, KV_HEADS, 64)
    query = torch.randn(3, 4, 64)

    def attend(out, query=query, query_rows=(0, 1, 2), caches=(key_cache, value_cache)):
        kernels.decode_attention(out, query, *caches, meta.block_table, meta.seq_lens,
                                 torch.tensor([0, 1, 2]), torch.tensor(query_rows), 0.3)
        return out

    expected = attend(torch.empty_like(query))
    in_place = query.clone()
    attend(in_place, query=in_place)  # allowed: each row reads its own query before writing
    torch.testing.assert_close(in_place, expected, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="given twice"):
        attend(torch.empty_like(query), query_rows=(0, 2, 0))
    with pytest.raises(RuntimeError, match="single memory location"):
        attend(torch.empty(1, 4, 64).expand(3, 4, 64))
    shifted = torch.cat([query, torch.zeros(1, 4, 64)])
    with pytest.raises(RuntimeError, match="single memory location"):
        attend(shifted[1:], query=shifted[:3])
    with pytest.raises(RuntimeError, match="single memory location"):
        attend(key_cache.view(-1, 4, 64)[:3])
    no_heads = torch.empty(*key_cache.shape[:2], 0, 64)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        attend(torch.empty_like(query), caches=(no_heads, no_heads))


def test_decode_kernel_keeps_an_infinite_value_in_a_partial_last_block():
    """The last block of a row reads 16 cache rows, those past the end with weight 0: an inf
    in the last real value must give inf, as in torch, not 0 * inf = NaN."""
    meta = paged_layout([20], [1], 16, seed=3)  # 21 positions: the last block has 5
    key_cache, value_cache = random_caches(meta, 16, KV_HEADS, 64)
    last_block = meta.block_table[0, 1]
    value_cache[last_block, 4, :, 0] = float("inf")  # position 20, the row's last
    query = torch.randn(1, 2 * KV_HEADS, 64)
    out = torch.empty_like(query)
    load_cpu_kernels().decode_attention(out, query, key_cache, value_cache, meta.block_table,
                                        meta.seq_lens, torch.tensor([0]), torch.tensor([0]),
                                        0.17)
    ref = reference_paged_attention(query, key_cache, value_cache, meta, 0.17)
    assert torch.isinf(ref[0, :, 0]).all()
    torch.testing.assert_close(out, ref, equal_nan=True)


def _prefill(meta, query, key_cache, value_cache, scale=0.17, requests=None, out=None):
    out = torch.full_like(query, float("nan")) if out is None else out
    requests = meta.prefill_requests_cpu if requests is None else torch.tensor(requests)
    load_cpu_kernels().prefill_attention(out, query, key_cache, value_cache, meta.block_table,
                                         meta.seq_lens, meta.query_start_loc, requests, scale)
    return out


# group 3: a head's 16 rows of an item end mid-position; 8: two positions an item
@pytest.mark.parametrize("block_size,head_dim,group", [(16, 64, 2), (16, 32, 1), (32, 80, 4),
                                                       (8, 128, 8), (16, 96, 3), (16, 256, 1)])
def test_prefill_kernel_matches_the_reference(block_size, head_dim, group):
    """Chunks from scratch and over cached context, of lengths around the kernel's 16-row
    and 16-key tiles, beside each other in one call."""
    context = [0, 0, 16, 40, 3, 0, 250]
    query_lens = [2, 17, 16, 33, 70, 200, 9]
    meta = paged_layout(context, query_lens, block_size, seed=head_dim + group)
    key_cache, value_cache = random_caches(meta, block_size, KV_HEADS, head_dim)
    query = torch.randn(meta.num_actual_tokens, KV_HEADS * group, head_dim)
    got = _prefill(meta, query, key_cache, value_cache)
    ref = reference_paged_attention(query, key_cache, value_cache, meta, 0.17)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=0)


def test_cpu_backend_sends_float32_prefill_to_the_kernel(monkeypatch):
    """Only the kernel may answer: the torch path is made to fail."""
    def torch_path(*args):
        raise AssertionError("a float32 prefill chunk took the torch path")

    monkeypatch.setattr(TorchAttentionBackend, "_prefill", torch_path)
    got, ref = _run(get_attention_backend("cpu", "cpu"), [0, 30, 7], [40, 1, 12], 16, 64, 2,
                    torch.float32)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=0)


def test_prefill_kernel_leaves_other_rows_and_takes_its_output_in_place():
    """Rows of requests not listed stay as they were; out may be the query itself."""
    meta = paged_layout([0, 5, 0], [20, 1, 18], 16, seed=2)
    key_cache, value_cache = random_caches(meta, 16, KV_HEADS, 64)
    query = torch.randn(meta.num_actual_tokens, 2 * KV_HEADS, 64)
    got = _prefill(meta, query, key_cache, value_cache, requests=[2])
    ref = reference_paged_attention(query, key_cache, value_cache, meta, 0.17)
    assert torch.isnan(got[:21]).all()
    torch.testing.assert_close(got[21:], ref[21:], atol=2e-5, rtol=0)
    in_place = query.clone()
    _prefill(meta, in_place, key_cache, value_cache, requests=[0, 2], out=in_place)
    torch.testing.assert_close(in_place[:20], ref[:20], atol=2e-5, rtol=0)
    torch.testing.assert_close(in_place[21:], ref[21:], atol=2e-5, rtol=0)


def test_prefill_kernel_softmax_survives_rows_whose_first_keys_score_minus_inf():
    """The first 16 positions score -inf (a -inf key feature against a positive query one):
    rows among them see only -inf until later keys, which must then count in full."""
    meta = paged_layout([0], [40], 16, seed=4)
    key_cache, value_cache = random_caches(meta, 16, KV_HEADS, 64)
    key_cache[meta.block_table[0, 0], :, :, 0] = float("-inf")
    query = torch.randn(40, 2 * KV_HEADS, 64)
    query[..., 0] = 1.0
    got = _prefill(meta, query, key_cache, value_cache)
    ref = reference_paged_attention(query, key_cache, value_cache, meta, 0.17)
    assert torch.isnan(ref[:16]).all() and torch.isfinite(ref[16:]).all()
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=0, equal_nan=True)


def test_prefill_kernel_rejects_bad_inputs_instead_of_reading_past_them():
    meta = paged_layout([0, 4], [6, 20], 16, seed=0)  # rows [0, 6) and [6, 26)
    key_cache, value_cache = random_caches(meta, 16, KV_HEADS, 64)
    query = torch.randn(26, 4, 64)
    assert torch.isfinite(_prefill(meta, query, key_cache, value_cache)).all()  # the valid call

    def attend(requests=None, **changes):
        return _prefill(dataclasses.replace(meta, **changes), query, key_cache, value_cache,
                        requests=requests)

    with pytest.raises(RuntimeError, match="request 2 out of range"):
        attend(requests=[0, 2])
    with pytest.raises(RuntimeError, match="query row 6 given twice"):
        attend(requests=[1, 1])
    with pytest.raises(RuntimeError, match="not within the query's 26"):
        attend(query_start_loc=torch.tensor([0, 6, 27], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="not within the query's 26"):
        attend(query_start_loc=torch.tensor([0, 6, 6], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="20 query rows but a context of 10"):
        attend(seq_lens=torch.tensor([6, 10], dtype=torch.int32))
    _rejects_contexts_past_their_blocks(
        meta, lambda lens, table: attend(seq_lens=lens, block_table=table))
    with pytest.raises(RuntimeError, match="float32 expected"):
        _prefill(meta, query.to(torch.bfloat16), key_cache.to(torch.bfloat16),
                 value_cache.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="head_dim"):
        _prefill(meta, torch.randn(26, 4, 48), *random_caches(meta, 16, KV_HEADS, 48))
