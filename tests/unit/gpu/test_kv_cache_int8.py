"""The KV cache in 8 bits (``--kv-cache-dtype int8``, ``gpu/attention/kv_quant.py``): the cache
writes give the torch reference's int8 values and scales, and every attention backend over an
int8 cache gives what the reference attention gives over the dequantized cache, on ragged paged
layouts with GQA, decode rows and prefill chunks over cached context.

The ``torch`` backend, the Triton kernels and the engine run on ``TIDAL_TEST_DEVICE`` (the GPU
suite, ``-m gpu``); the C++ CPU kernels' tests are ``cpu_only``. Without a GPU the Triton
kernels run in Triton's interpreter on the CPU.
"""

from __future__ import annotations

import os
import random
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.device import KERNEL_TEST_DEVICE, TEST_DEVICE, on_test_device  # noqa: E402
from tidal.gpu.attention import get_attention_backend  # noqa: E402
from tidal.gpu.attention.kv_quant import (  # noqa: E402
    dequantize,
    quantize_caches,
    quantize_heads,
    write_quantized,
)
from tidal.gpu.attention.metadata import AttentionMetadata  # noqa: E402
from tidal.gpu.attention.paged_layout import paged_layout, random_caches  # noqa: E402
from tidal.gpu.attention.torch_ref import reference_paged_attention  # noqa: E402
from tidal.gpu.cpu.kernels import load_cpu_kernels  # noqa: E402

pytestmark = pytest.mark.gpu

KV_HEADS = 2
# (block_size, head_dim, GQA group): the kernels' head sizes, a block wider and narrower than a
# vector of positions, and head_dim 40, which the compiled kernels hand to the torch path
LAYOUTS = [(16, 64, 2), (16, 32, 1), (32, 80, 4), (8, 128, 8), (16, 96, 3), (16, 256, 2),
           (16, 40, 2)]
# float32 rounding of sums taken in another order: up to 4.3e-5 over 15 seeds (prefill, head
# 256, keys scaled up to 4x). A wrong scale or element would be off by the values' size, ~1.
ATOL = 1e-4
# The C++ kernels are built (not merely looked up) on the CPU alone: the GPU suite skips their
# tests (cpu_only) and never compiles them.
needs_kernels = pytest.mark.skipif(TEST_DEVICE == "cpu" and load_cpu_kernels() is None,
                                   reason="needs the C++ kernels")
cpu_only = pytest.mark.cpu_only(reason="tests the C++ CPU kernels (the GPU runs the torch and "
                                         "Triton cases)")
# The torch backend's tests run on TEST_DEVICE beside the C++ kernels' (CPU only).
BACKENDS = [pytest.param("cpu", marks=cpu_only), "torch"]
# The engine's own attention kernels on TEST_DEVICE, which the engine tests hold to torch's
KERNEL_BACKEND = "cpu" if TEST_DEVICE == "cpu" else "triton"


def test_each_head_vector_rounds_to_within_half_a_step():
    with torch.device(TEST_DEVICE):
        x = torch.randn(50, 3, 64) * torch.rand(50, 3, 1) * 10
    x[0, 1] = 0  # an all-zero head: scale 0, values 0
    q, scale = quantize_heads(x)
    assert q.dtype == torch.int8 and scale.shape == (50, 3)
    assert torch.equal(scale, x.abs().amax(-1) * (1 / 127))
    assert int(q.abs().max()) == 127 and scale[0, 1] == 0 and not q[0, 1].any()
    err = (dequantize(q, scale) - x).abs()
    assert bool((err <= scale[..., None] * 0.5 + 1e-6).all())


def _slots(n: int, num_slots: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """Distinct slots for n rows, the last two padding (-1)."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=gen)[:n]
    slots[-2:] = -1
    return slots.to(device)


def _empty_int8(blocks: int, block_size: int, dim: int,
                device: str = "cpu") -> list[torch.Tensor]:
    shape = (blocks, block_size, KV_HEADS, dim)
    with torch.device(device):
        return [torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8),
                torch.zeros(shape[:3]), torch.zeros(shape[:3])]


@cpu_only
@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [32, 64, 128])
def test_cpu_cache_write_is_the_torch_reference_to_the_bit(dtype, dim):
    key = torch.randn(20, KV_HEADS, dim).to(dtype) * 3
    value = torch.randn(20, KV_HEADS, dim).to(dtype)
    slots = _slots(18, 6 * 16, seed=dim)  # two rows past the slots are ignored
    ours, ref = _empty_int8(6, 16, dim), _empty_int8(6, 16, dim)
    get_attention_backend("cpu", "cpu").write_kv(key, value, *ours[:2], slots, *ours[2:])
    write_quantized(key, value, *ref[:2], *ref[2:], slots)
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)
    assert ours[2].count_nonzero() == 16 * KV_HEADS  # the padded rows wrote nothing


def _contexts(block_size: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    fixed = [1, block_size - 1, block_size, block_size + 1, 5 * block_size + 3]
    return fixed + [rng.randint(1, 300) for _ in range(8)]


def _int8_caches(meta: AttentionMetadata, block_size: int,
                 dim: int) -> tuple[list[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """An int8 cache of random keys and values (heads of varied magnitude), and its
    dequantized float32 copy."""
    k, v = random_caches(meta, block_size, KV_HEADS, dim)  # on meta's device
    k *= torch.rand(k.shape[:3], device=k.device)[..., None] * 4
    caches = list(quantize_caches(k, v))
    return caches, (dequantize(caches[0], caches[2]), dequantize(caches[1], caches[3]))


def _attend(backend_name: str, context: list[int], query_lens: list[int], block_size: int,
            dim: int, group: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    device = "cpu" if backend_name == "cpu" else TEST_DEVICE
    meta = paged_layout(context, query_lens, block_size, seed=len(context) + dim, device=device)
    torch.manual_seed(block_size + dim + group)
    caches, dequantized = _int8_caches(meta, block_size, dim)
    query = torch.randn(meta.num_actual_tokens, KV_HEADS * group, dim, device=device).to(dtype)
    backend = get_attention_backend(backend_name, device)
    got = backend.forward(query, caches[0], caches[1], meta, 0.17, caches[2], caches[3])
    ref = reference_paged_attention(query.float(), *dequantized, meta, 0.17)
    return got, ref


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size,dim,group", LAYOUTS)
def test_decode_over_int8_is_attention_over_the_dequantized_cache(backend, block_size, dim,
                                                                   group):
    context = _contexts(block_size, seed=dim)
    got, ref = _attend(backend, context, [1] * len(context), block_size, dim, group,
                       torch.float32)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


@pytest.mark.cpu_only(reason="the C++ kernels' split of a stream's KV heads over CPU threads")
def test_a_single_stream_splits_its_kv_heads_over_the_threads():
    """One decode row with two threads: each takes one of the row's two KV heads, and its
    scales."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got, ref = _attend("cpu", [237], [1], 16, 64, 2, torch.float32)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_queries_over_int8(backend, dtype):
    """A bfloat16 or float16 model's queries over the int8 cache; the kernel computes in
    float32, so only the output's rounding differs."""
    context = _contexts(16, seed=7)
    got, ref = _attend(backend, context, [1] * len(context), 16, 64, 2, dtype)
    torch.testing.assert_close(got.float(), ref.to(dtype).float(), atol=3e-2, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size,dim,group", LAYOUTS)
def test_prefill_chunks_over_int8_match(backend, block_size, dim, group):
    """Chunks after cached context (prefix hits, earlier chunks), beside decode rows."""
    context = [0, 0, 37, block_size, 200, 5]
    query_lens = [1, 45, 20, 3, 64, 1]
    got, ref = _attend(backend, context, query_lens, block_size, dim, group, torch.float32)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


@cpu_only
@needs_kernels
def test_the_kernels_refuse_an_int8_cache_without_its_scales():
    meta = paged_layout([5], [1], 16, seed=0)
    caches, _ = _int8_caches(meta, 16, 64)
    query = torch.randn(1, KV_HEADS, 64)
    requests, rows = meta.decode_rows_cpu
    with pytest.raises(RuntimeError, match="scales"):
        load_cpu_kernels().decode_attention(torch.empty_like(query), query, caches[0], caches[1],
                                            meta.block_table, meta.seq_lens, requests, rows, 0.1)


@pytest.mark.cpu_only(reason="the C++ decode stack (decoder.cpp) is a CPU kernel")
@needs_kernels
def test_one_call_decode_step_takes_an_int8_cache_bitwise(tmp_path):
    """The C++ decode step (decoder.cpp) writes and reads the int8 cache as the Python model
    does: the same hidden states and the same cache bytes, to the bit."""
    from tidal.gpu.model_config import ModelConfig
    from tidal.gpu.model_loader import LoadOptions, load_model
    from tidal.gpu.random_model import build_model_dir

    path = build_model_dir(tmp_path, "llama", hidden_size=128)
    model, cpu = load_model(path, ModelConfig.from_dir(path), LoadOptions(
        get_attention_backend("cpu", "cpu"), 512, torch.float32, "cpu"))
    assert cpu.stack is not None
    cfg, context = model.config, [0, 1, 15, 16, 17, 83, 200]
    meta = paged_layout(context, [1] * len(context), 16, seed=3)
    caches = []
    for _ in range(cfg.num_layers):
        k, v = random_caches(meta, 16, cfg.num_kv_heads, cfg.head_dim)
        caches.append(quantize_caches(k, v))
    ids = torch.randint(0, cfg.vocab_size, (len(context),))
    positions = torch.tensor(context)
    outs, written = [], []
    for stack in (None, cpu.stack):
        step = replace(cpu, stack=stack)
        copies = [tuple(t.clone() for t in layer) for layer in caches]
        with torch.inference_mode():
            hidden = step.forward(ids, positions, copies, meta)
            outs.append(model(ids, positions, copies, meta) if hidden is None else hidden)
        written.append(copies)
    assert torch.equal(outs[0], outs[1])
    for python_layer, stack_layer in zip(*written):
        for a, b in zip(python_layer, stack_layer):
            assert torch.equal(a, b)


# -- Triton: on KERNEL_TEST_DEVICE, in its interpreter on the CPU ------------------------------
@pytest.fixture
def triton_kernels():
    """The Triton kernels, interpreted without CUDA (set at the top of this file: Triton reads
    the setting when triton.language is first imported, which something else may do first);
    compiled on a GPU."""
    pytest.importorskip("triton")
    from tidal.gpu.attention import triton_kernels

    return triton_kernels


@pytest.mark.parametrize("dim", [16, 64, 80])
def test_triton_cache_write_is_the_reference_within_a_tie(triton_kernels, dim):
    """The same scales; values equal but where x / scale falls on a tie, which Triton rounds
    away from zero and the reference to even (at most one step apart)."""
    # drawn on the CPU on every device: the same values, so the same (few) ties
    key, value = torch.randn(12, KV_HEADS, dim) * 3, torch.randn(12, KV_HEADS, dim)
    key, value = key.to(KERNEL_TEST_DEVICE), value.to(KERNEL_TEST_DEVICE)
    slots = _slots(10, 4 * 16, seed=dim, device=KERNEL_TEST_DEVICE)
    ours = _empty_int8(4, 16, dim, KERNEL_TEST_DEVICE)
    ref = _empty_int8(4, 16, dim, KERNEL_TEST_DEVICE)
    triton_kernels.write_kv(key, value, *ours[:2], slots, *ours[2:])
    write_quantized(key, value, *ref[:2], *ref[2:], slots)
    for a, b in zip(ours[2:], ref[2:]):
        assert torch.equal(a, b)
    for a, b in zip(ours[:2], ref[:2]):
        diff = (a.int() - b.int()).abs()
        assert int(diff.max()) <= 1 and int((diff > 0).sum()) <= 2


@pytest.mark.parametrize("block_size,dim,group", [(16, 16, 1), (16, 64, 2), (32, 80, 2)])
@pytest.mark.parametrize("query_lens", ["decode", "mixed"])
def test_triton_attention_over_int8_matches(triton_kernels, block_size, dim, group, query_lens):
    from tidal.gpu.attention.triton_backend import TritonAttentionBackend

    context = [1, block_size - 1, block_size + 1, 37]
    lens = [1] * 4 if query_lens == "decode" else [1, 9, 1, 20]
    meta = paged_layout(context, lens, block_size, seed=dim, device=KERNEL_TEST_DEVICE)
    caches, dequantized = _int8_caches(meta, block_size, dim)
    query = torch.randn(meta.num_actual_tokens, KV_HEADS * group, dim, device=KERNEL_TEST_DEVICE)
    got = TritonAttentionBackend().forward(query, caches[0], caches[1], meta, 0.2, *caches[2:])
    ref = reference_paged_attention(query, *dequantized, meta, 0.2)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


# -- the engine end to end ---------------------------------------------------------------
def _greedy(llm, prompts: list, tokens: int) -> list:
    from tidal.core import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=0)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from tidal.gpu.random_model import build_model_dir

    # head_dim 32, which the compiled kernels take
    return str(build_model_dir(tmp_path_factory.mktemp("llama"), "llama", hidden_size=128))


def _prompts(seed: int) -> list[list[int]]:
    """8 prompts of 20-90 tokens, half of them sharing a 40-token prefix (prefix caching)."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 500, (40,), generator=gen).tolist()
    rest = [torch.randint(3, 500, (int(n),), generator=gen).tolist()
            for n in torch.randint(20, 50, (8,), generator=gen)]
    return [shared + r if i % 2 else r for i, r in enumerate(rest)]


@pytest.mark.parametrize("dtype,ratio", [("float32", 128 / 36), ("bfloat16", 64 / 36)])
def test_the_same_memory_holds_more_blocks(llama_dir, dtype, ratio):
    """head_dim 32: 4 (float32) or 2 (bfloat16) bytes an element against 1, plus a float32
    scale per 32 elements."""
    from tidal.core import LLM

    memory = 4 << 20
    blocks = {kv: LLM(llama_dir, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=memory,
                      device=TEST_DEVICE).engine.kv.num_blocks for kv in ("auto", "int8")}
    per_token = 2 * 2 * 2 * (32 + 4)  # K and V, 2 layers, 2 KV heads, int8 elements + scale
    assert blocks["int8"] == memory // (16 * per_token)
    assert blocks["int8"] / blocks["auto"] == pytest.approx(ratio, rel=0.01)


def test_engine_over_int8_gives_the_torch_reference_tokens(llama_dir):
    """The device's kernels (the C++ kernels on the CPU, Triton on a GPU) against the torch
    backend over the same int8 cache, through prefix caching, chunked prefill (24-token
    steps), preemption (a cache of 24 blocks for about 45 blocks of requests) and the
    scheduling the device does not default to (async on the CPU, sync on a GPU): the same
    greedy tokens. In float32 (the CPU's default) on every device."""
    from tidal.core import LLM

    prompts = _prompts(0)
    common = dict(kv_cache_dtype="int8", kv_cache_memory=24 * 16 * 288,
                  max_num_batched_tokens=24, max_model_len=256, dtype="float32",
                  device=TEST_DEVICE)
    other = ("async", True) if TEST_DEVICE == "cpu" else ("sync", False)
    runs = {}
    for name, extra in (("torch", dict(attention_backend="torch")),
                        (KERNEL_BACKEND, dict(attention_backend=KERNEL_BACKEND)),
                        (other[0], dict(attention_backend=KERNEL_BACKEND,
                                        async_scheduling=other[1]))):
        llm = LLM(llama_dir, **common, **extra)
        runs[name] = [o.token_ids for o in _greedy(llm, prompts, 40)]
        assert llm.engine.kv.num_blocks == 24 and llm.engine.kv.pool.num_free_blocks == 24
        assert llm.engine.scheduler.num_preemptions > 0
    assert runs[KERNEL_BACKEND] == runs["torch"]
    assert runs[other[0]] == runs["torch"]


DEFAULT_PROMPTS = ["To be, or not to be", "ROMEO:", "First Citizen:\nBefore we proceed",
                   "KING HENRY:", "O Romeo, Romeo!", "Friends, Romans, countrymen,",
                   "Now is the winter", "JULIET:\nWhat"]
# On the embedded model (8 prompts x 64 tokens, AVX-512 host) the int8 cache's top logprobs
# were within 0.026 nats of the float cache's (median 0.0014) wherever the two had produced
# the same tokens so far, and 7 of 8 replies were the same 64 tokens (the eighth from token 40).
# Measured in float32, which the test runs in on every device (a GPU's default is bfloat16,
# whose own rounding the bound was not set for).
LOGPROB_BOUND = 0.05


@pytest.mark.slow
def test_embedded_model_keeps_its_greedy_tokens_and_logprobs():
    from tidal.core import LLM

    outs = {kv: _greedy(LLM(**on_test_device(kv_cache_dtype=kv, dtype="float32")),
                        DEFAULT_PROMPTS, 64) for kv in ("auto", "int8")}
    diffs = []
    for ref, got in zip(outs["auto"], outs["int8"]):
        same = next((i for i, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)) if a != b),
                    len(ref.token_ids))
        assert same >= 16, "greedy tokens differ among the first 16"
        diffs += [abs(ref.logprobs[i][ref.token_ids[i]] - got.logprobs[i][got.token_ids[i]])
                  for i in range(same)]
    within = sum(d <= LOGPROB_BOUND for d in diffs) / len(diffs)
    assert within >= 0.99 and len(diffs) >= 0.9 * 8 * 64
