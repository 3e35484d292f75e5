"""The Triton kernels against the torch reference on random paged layouts: block sizes, head
dims, GQA ratios, ragged lengths crossing block boundaries, padded slots and rows.

Without CUDA they run in Triton's interpreter on small shapes; on a GPU (``TIDAL_TEST_DEVICE``,
else CUDA where there is one) at full sizes: contexts across many blocks, decode in splits.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

from tests.device import KERNEL_TEST_DEVICE  # noqa: E402
from tests.paths import ROOT
from tidal.gpu.attention import triton_kernels as tk  # noqa: E402
from tidal.gpu.attention.metadata import AttentionMetadata  # noqa: E402
from tidal.gpu.attention.paged_layout import paged_layout, random_caches  # noqa: E402
from tidal.gpu.attention.torch_ref import TorchAttentionBackend, reference_paged_attention  # noqa: E402
from tidal.gpu.attention.triton_backend import TritonAttentionBackend  # noqa: E402

pytestmark = pytest.mark.gpu

DEVICE = KERNEL_TEST_DEVICE
ON_GPU = DEVICE != "cpu"
# (block_size, head_dim, GQA group); the GPU also runs the 64/128 cases at larger sizes
SHAPES = [(16, 16, 1), (16, 64, 2), (32, 128, 4), (32, 80, 2)]
KV_HEADS = 2
# per case: extra random requests and the longest random context. On a GPU, contexts of up to
# ~94 blocks of 16 (47 of 32), which decode splits into ~6 parts (decode_num_splits: 11
# requests on 132 SMs); few requests, since the torch reference attends one at a time.
NUM_RANDOM, MAX_CONTEXT = (6, 1500) if ON_GPU else (2, 90)
ATOL = {torch.float32: 2e-5 if not ON_GPU else 1e-4, torch.bfloat16: 3e-2}


def _rng(*key: object) -> random.Random:
    return random.Random(str(key))


def _layout(context: list[int], query: list[int], block_size: int, seed: int,
            pad_rows: int = 0) -> AttentionMetadata:
    return paged_layout(context, query, block_size, seed, pad_rows, DEVICE)


def _caches(meta: AttentionMetadata, block_size: int, head_dim: int,
            dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    return random_caches(meta, block_size, KV_HEADS, head_dim, dtype)


def _boundary_lengths(block_size: int, rng: random.Random) -> list[int]:
    """Context lengths at and around block boundaries, plus random ones."""
    fixed = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5]
    return fixed + [rng.randint(1, MAX_CONTEXT) for _ in range(NUM_RANDOM)]


def _assert_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(got.float(), ref.float(), atol=ATOL[got.dtype], rtol=0)


# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size,head_dim", [(16, 16), (32, 64), (16, 128)])
def test_write_kv_stores_at_slots_and_skips_padding(block_size, head_dim):
    rng = _rng("write", block_size, head_dim)
    meta = _layout([0, 7, 2 * block_size - 1], [5, block_size + 2, 1], block_size, seed=1,
                   pad_rows=3)
    n = meta.slot_mapping.shape[0]
    # value as a strided slice of a fused projection, as the model hands it over
    fused = torch.randn(n + 2, 3, KV_HEADS, head_dim, device=DEVICE)
    key, value = fused[:, 0].contiguous(), fused[:, 2]
    key_cache, value_cache = _caches(meta, block_size, head_dim)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    slots = meta.slot_mapping.clone()
    slots[rng.randrange(meta.num_actual_tokens)] = -1  # a padded slot mid-batch too
    tk.write_kv(key, value, key_cache, value_cache, slots)
    valid = slots >= 0
    want_k.view(-1, KV_HEADS, head_dim)[slots[valid]] = key[:n][valid]
    want_v.view(-1, KV_HEADS, head_dim)[slots[valid]] = value[:n][valid]
    assert torch.equal(key_cache, want_k)
    assert torch.equal(value_cache, want_v)


@pytest.mark.parametrize("block_size,head_dim,group", SHAPES)
@pytest.mark.parametrize("num_splits", [None, 3])
def test_decode_matches_reference(block_size, head_dim, group, num_splits):
    rng = _rng("decode", block_size, head_dim, group)
    context = _boundary_lengths(block_size, rng)
    meta = _layout(context, [1] * len(context), block_size, seed=2)
    key_cache, value_cache = _caches(meta, block_size, head_dim)
    query = torch.randn(len(context), KV_HEADS * group, head_dim, device=DEVICE)
    ref = reference_paged_attention(query, key_cache, value_cache, meta, head_dim ** -0.5)
    got = tk.paged_decode(query, key_cache, value_cache, meta.block_table, meta.seq_lens,
                          head_dim ** -0.5, meta.max_seq_len, num_splits=num_splits)
    _assert_close(got, ref)


@pytest.mark.parametrize("num_splits,block_n", [(1, 32), (2, 16), (7, 16), (12, 32)])
def test_decode_split_count_and_tile_do_not_change_the_result(num_splits, block_n):
    """More splits than tiles leaves some splits empty; a request of length 0 (a padded
    CUDA-graph row) reads nothing and gets zeros."""
    block_size, head_dim, group = 16, 32, 4
    context = [1, 15, 17, 40, 100]
    meta = _layout(context, [1] * len(context), block_size, seed=3)
    key_cache, value_cache = _caches(meta, block_size, head_dim)
    query = torch.randn(len(context) + 1, KV_HEADS * group, head_dim, device=DEVICE)
    ref = reference_paged_attention(query[:-1], key_cache, value_cache, meta, 0.2)
    seq_lens = torch.cat([meta.seq_lens, meta.seq_lens.new_zeros(1)])
    table = torch.cat([meta.block_table, meta.block_table[:1]])
    got = tk.paged_decode(query, key_cache, value_cache, table, seq_lens, 0.2, 2048,
                          num_splits=num_splits, block_n=block_n)
    _assert_close(got[:-1], ref)
    assert torch.equal(got[-1], torch.zeros_like(got[-1]))


def _mixed_case(block_size: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """(cached context, new query tokens) per request: fresh prompts, chunks on top of
    prefix-cache hits or earlier chunks, decode rows, chunks ending on block boundaries."""
    context = [0, 0, block_size, 2 * block_size + 3, 5, block_size - 1]
    query = [1, block_size + 3, block_size, 7, 1, 2 * block_size + 1]
    for _ in range(NUM_RANDOM):
        context.append(rng.randint(0, MAX_CONTEXT))
        query.append(rng.choice([1, rng.randint(1, 3 * block_size)]))
    return context, query


@pytest.mark.parametrize("block_size,head_dim,group", SHAPES)
def test_prefill_and_mixed_match_reference(block_size, head_dim, group):
    rng = _rng("prefill", block_size, head_dim, group)
    context, query_lens = _mixed_case(block_size, rng)
    meta = _layout(context, query_lens, block_size, seed=4)
    key_cache, value_cache = _caches(meta, block_size, head_dim)
    query = torch.randn(meta.num_actual_tokens, KV_HEADS * group, head_dim, device=DEVICE)
    ref = reference_paged_attention(query, key_cache, value_cache, meta, head_dim ** -0.5)
    got = tk.paged_prefill(query, key_cache, value_cache, meta.block_table, meta.seq_lens,
                           meta.query_start_loc, head_dim ** -0.5, meta.max_query_len)
    _assert_close(got, ref)


@pytest.mark.parametrize("block_q,block_n", [(1, 16), (4, 32), (16, 16)])
def test_prefill_tiling_does_not_change_the_result(block_q, block_n):
    block_size, head_dim, group = 16, 32, 2
    context, query_lens = [0, 20, 3], [37, 18, 1]
    meta = _layout(context, query_lens, block_size, seed=5)
    key_cache, value_cache = _caches(meta, block_size, head_dim)
    query = torch.randn(meta.num_actual_tokens, KV_HEADS * group, head_dim, device=DEVICE)
    ref = reference_paged_attention(query, key_cache, value_cache, meta, 0.3)
    got = tk.paged_prefill(query, key_cache, value_cache, meta.block_table, meta.seq_lens,
                           meta.query_start_loc, 0.3, meta.max_query_len, block_q=block_q,
                           block_n=block_n)
    _assert_close(got, ref)


@pytest.mark.parametrize("decode_only", [True, False])
def test_bfloat16_matches_reference(decode_only):
    block_size, head_dim, group = 16, 64, 4
    context = [5, 16, 33, 70]
    query_lens = [1] * 4 if decode_only else [1, 9, 1, 20]
    meta = _layout(context, query_lens, block_size, seed=6)
    key_cache, value_cache = _caches(meta, block_size, head_dim, torch.bfloat16)
    query = torch.randn(meta.num_actual_tokens, KV_HEADS * group, head_dim,
                        device=DEVICE).to(torch.bfloat16)
    ref = reference_paged_attention(query.float(), key_cache.float(), value_cache.float(), meta,
                                    head_dim ** -0.5)
    got = TritonAttentionBackend().forward(query, key_cache, value_cache, meta,
                                           head_dim ** -0.5)
    assert got.dtype == torch.bfloat16
    _assert_close(got, ref)


@pytest.mark.parametrize("decode_only", [True, False])
def test_backend_step_matches_torch_backend(decode_only):
    """write_kv then attention, as a model layer runs them, with padded rows past the last
    request (slot -1): same cache, same outputs, zeros in the padding."""
    block_size, head_dim, group = 32, 64, 2
    context = [0, 31, 32, 50] if not decode_only else [3, 31, 32, 50]
    query_lens = [1, 1, 1, 1] if decode_only else [12, 1, 5, 1]
    meta = _layout(context, query_lens, block_size, seed=7, pad_rows=3)
    n = meta.slot_mapping.shape[0]
    query = torch.randn(n, KV_HEADS * group, head_dim, device=DEVICE)
    key = torch.randn(n, KV_HEADS, head_dim, device=DEVICE)
    value = torch.randn(n, KV_HEADS, head_dim, device=DEVICE)
    outs, caches = [], []
    for backend in (TritonAttentionBackend(), TorchAttentionBackend()):
        key_cache, value_cache = (c.to(DEVICE) for c in _caches(meta, block_size, head_dim))
        torch.manual_seed(0)
        key_cache.normal_()
        value_cache.normal_()
        backend.write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
        outs.append(backend.forward(query, key_cache, value_cache, meta, 0.125))
        caches.append((key_cache, value_cache))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    _assert_close(outs[0], outs[1])
    assert torch.equal(outs[0][meta.num_actual_tokens:],
                       torch.zeros_like(outs[0][meta.num_actual_tokens:]))


def test_decode_num_splits_grows_with_context_and_shrinks_with_batch():
    dev = torch.device(DEVICE)
    assert tk.decode_num_splits(1, 2, 100, dev) == 1
    assert tk.decode_num_splits(1, 2, 4096, dev) > 1
    assert tk.decode_num_splits(1, 2, 10**6, dev) <= tk.MAX_DECODE_SPLITS
    assert tk.decode_num_splits(4096, 8, 10**6, dev) == 1


# ---------------------------------------------------------------------------------------
_PTRS_I32 = ("block_table_ptr", "seq_lens_ptr", "query_start_loc_ptr")
_PTRS_F32 = ("mid_o_ptr", "mid_lse_ptr", "k_scale_ptr", "v_scale_ptr")
_CACHE_PTRS = ("k_cache_ptr", "v_cache_ptr", "key_cache_ptr", "value_cache_ptr")
_F = dict(PRECISION="tf32", UPCAST=False)
HOPPER_BUILDS = {  # kernel -> constexprs, in the model's dtype and shapes; QUANT: an int8 cache
    "write_kv": ("_write_kv_kernel", dict(HEADS=8, DIM=64, QUANT=False)),
    "write_kv-int8": ("_write_kv_kernel", dict(HEADS=8, DIM=64, QUANT=True)),
    "decode": ("_decode_kernel", dict(BLOCK_SIZE=16, GROUP_PAD=16, DIM=64, BLOCK_N=64,
                                      SPLIT=False, QUANT=False, **_F)),
    "decode-split": ("_decode_kernel", dict(BLOCK_SIZE=16, GROUP_PAD=16, DIM=128, BLOCK_N=64,
                                            SPLIT=True, QUANT=False, **_F)),
    "decode-int8": ("_decode_kernel", dict(BLOCK_SIZE=16, GROUP_PAD=16, DIM=128, BLOCK_N=64,
                                           SPLIT=True, QUANT=True, **_F)),
    "merge": ("_merge_splits_kernel", dict(SPLITS_PAD=8, DIM=64)),
    "decode-sinks": ("_decode_kernel", dict(BLOCK_SIZE=16, GROUP_PAD=16, DIM=64, BLOCK_N=64,
                                            SPLIT=False, QUANT=False, SINKS=True, **_F)),
    "merge-sinks": ("_merge_splits_kernel", dict(SPLITS_PAD=8, DIM=64, SINKS=True)),
    "prefill-sinks": ("_prefill_kernel", dict(BLOCK_SIZE=16, GROUP_PAD=8, BLOCK_Q=8, DIM=64,
                                              BLOCK_N=64, QUANT=False, SINKS=True, **_F)),
    "prefill-gqa": ("_prefill_kernel", dict(BLOCK_SIZE=16, GROUP_PAD=8, BLOCK_Q=8, DIM=64,
                                            BLOCK_N=64, QUANT=False, **_F)),
    "prefill-mha": ("_prefill_kernel", dict(BLOCK_SIZE=32, GROUP_PAD=1, BLOCK_Q=64, DIM=128,
                                            BLOCK_N=64, QUANT=False, **_F)),
    "prefill-int8": ("_prefill_kernel", dict(BLOCK_SIZE=16, GROUP_PAD=8, BLOCK_Q=8, DIM=64,
                                             BLOCK_N=64, QUANT=True, **_F)),
}


def compile_for_hopper() -> None:
    """Compile every ``HOPPER_BUILDS`` kernel to an sm_90 cubin (needs compiled kernels:
    ``TRITON_INTERPRET=0``; no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    assert not tk.interpreting()
    from tidal.gpu.attention import triton_cache_write

    for build, (name, constexprs) in HOPPER_BUILDS.items():
        kernel = getattr(tk, name, None) or getattr(triton_cache_write, name)
        signature = {arg: _arg_type(arg, constexprs) for arg in kernel.arg_names}
        source = ASTSource(kernel, signature,
                           {(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
        compiled = compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        assert len(compiled.asm["cubin"]) > 1000, build
        assert compiled.metadata.shared <= 228 * 1024, build
        print(build, "shared", compiled.metadata.shared, "cubin", len(compiled.asm["cubin"]))


def _arg_type(arg: str, constexprs: dict) -> str:
    if arg in constexprs:
        return "constexpr"
    if arg == "slot_ptr":
        return "*i64"
    if arg in _CACHE_PTRS and constexprs.get("QUANT"):
        return "*i8"
    if arg.endswith("_ptr"):
        return "*i32" if arg in _PTRS_I32 else "*fp32" if arg in _PTRS_F32 else "*bf16"
    return "fp32" if arg == "scale" else "i32"


@pytest.mark.slow
@pytest.mark.cpu_only(reason="the GPU compiles and runs the kernels themselves")
def test_kernels_compile_for_hopper(tmp_path):
    """The compiled (not interpreted) kernels lower to sm_90 cubins in bfloat16: Triton's type
    and shape checks and ptxas, with or without a GPU at hand. In a fresh process, since the
    interpreter, once on, is on for the whole process."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path),
               TRITON_DEFAULT_FP_FUSION="1")
    code = "from tests.unit.gpu.test_triton_kernels import compile_for_hopper; compile_for_hopper()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("cubin") == len(HOPPER_BUILDS)


@pytest.mark.slow
def test_llm_greedy_tokens_match_torch_backend(tmp_path):
    """The whole engine on the Triton backend: prefill, chunked prefill over prefix-cached
    blocks, mixed and decode-only steps give the torch backend's greedy tokens and logprobs."""
    from tidal.core import LLM, SamplingParams
    from tidal.gpu.random_model import build_model_dir

    path = str(build_model_dir(tmp_path / "llama", "llama"))
    rng = random.Random(8)
    shared = [rng.randrange(6, 400) for _ in range(20)]
    prompts = [shared + [rng.randrange(6, 400) for _ in range(n)] for n in (3, 30)]
    prompts.append([rng.randrange(6, 400) for _ in range(9)])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    results = {}
    for name in ("torch", "triton"):  # triton with overlap, as on the GPU
        llm = LLM(path, attention_backend=name, max_num_batched_tokens=32, device=DEVICE,
                  dtype="float32", async_scheduling=name == "triton",
                  kv_cache_memory=64 << 20)  # on a GPU, room for both engines
        llm.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)
        results[name] = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.stats().prefix_cache_hits > 0
    for ref, got in zip(results["torch"], results["triton"]):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        for ref_lp, got_lp in zip(ref.outputs[0].logprobs, got.outputs[0].logprobs):
            assert got_lp.keys() == ref_lp.keys()
            for token_id, value in ref_lp.items():
                assert got_lp[token_id] == pytest.approx(value, abs=1e-3)
