"""The fused element-wise Triton kernels (``gpu/triton_elementwise.py``) against the torch forms
of ``gpu/layers.py``: RMSNorm with and without the residual add, SiLU·up and rotary
embeddings, on contiguous tensors and on the strided q/k views of a fused qkv projection.

Without CUDA they run in Triton's interpreter; on a GPU (``TIDAL_TEST_DEVICE``) compiled."""

from __future__ import annotations

import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from tests.device import KERNEL_TEST_DEVICE  # noqa: E402
from tidal.gpu import triton_elementwise as te  # noqa: E402
from tidal.gpu.layers import (  # noqa: E402
    _rotary_table,
    rms_norm_torch,
    rotary_torch,
    silu_and_mul_torch,
)

pytestmark = pytest.mark.gpu

DEVICE = KERNEL_TEST_DEVICE
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# Triton's interpreter rounds float32 to bfloat16 by truncation, where the GPU (and torch)
# round to nearest even: there a bfloat16 result may be a few units in the last place of the
# tensor's largest values off (rotary's sums cancel, so not of its own value).
INTERPRETED_BF16_ULPS = 4


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal but for the order of a float32 sum: at most one unit in the last place of the
    dtype on a few elements (float32: a relative 1e-5)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        return
    eps = torch.finfo(want.dtype).eps
    diff = (got.float() - want.float()).abs()
    if DEVICE == "cpu" and want.dtype == torch.bfloat16:
        bound = INTERPRETED_BF16_ULPS * eps * want.float().abs().max()
        assert (diff <= bound).all(), f"max diff {diff.max().item()}, bound {bound.item()}"
        return
    ulp = eps * want.float().abs().clamp_min(1e-2)
    assert (diff <= ulp * 1.01).all(), f"max diff {diff.max().item()}"
    assert (diff > 0).float().mean().item() < 0.02  # nearly every element identical


def _rand(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 2).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 64), (7, 896), (3, 1000)])
def test_rms_norm(dtype: torch.dtype, rows: int, dim: int) -> None:
    x = _rand(rows, dim, dtype=dtype)
    w = _rand(dim, dtype=dtype, seed=1)
    _close(te.rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(dtype: torch.dtype) -> None:
    x, delta = _rand(5, 512, dtype=dtype), _rand(5, 512, dtype=dtype, seed=2)
    w = _rand(512, dtype=dtype, seed=1)
    total, normed = te.add_rms_norm(x, delta, w, 1e-5)
    want_total = x + delta
    _close(total, want_total)  # one rounding of one sum: exact where rounded to nearest
    if not (DEVICE == "cpu" and dtype == torch.bfloat16):
        assert torch.equal(total, want_total)
    _close(normed, rms_norm_torch(want_total, w, 1e-5))


def test_rms_norm_on_head_views() -> None:
    """Qwen3's q/k norm: rows of head_dim inside the strided q view of a qkv projection."""
    qkv = _rand(6, 4 * 64 + 2 * 2 * 64, dtype=torch.bfloat16)
    q = qkv[:, : 4 * 64].view(6, 4, 64)
    w = _rand(64, dtype=torch.bfloat16, seed=1)
    _close(te.rms_norm(q, w, 1e-6), rms_norm_torch(q, w, 1e-6))


def test_norm_weight_of_another_dtype() -> None:
    """A float32 weight on bfloat16 rows gives float32, as torch's promotion does."""
    x, w = _rand(3, 128, dtype=torch.bfloat16), _rand(128, dtype=torch.float32, seed=1)
    got, want = te.rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6)
    assert got.dtype == want.dtype == torch.float32
    # the normalised rows are rounded to bfloat16 before the float32 product
    rtol = INTERPRETED_BF16_ULPS * torch.finfo(torch.bfloat16).eps if DEVICE == "cpu" else 1e-5
    torch.testing.assert_close(got, want, rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 256), (9, 1500)])
def test_silu_and_mul(dtype: torch.dtype, rows: int, n: int) -> None:
    gate_up = _rand(rows, 2 * n, dtype=dtype)
    _close(te.silu_and_mul(gate_up), silu_and_mul_torch(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 4, 2), (128, 3, 1), (80, 2, 2)])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_rotary_on_qkv_views(dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int,
                             index_dtype: torch.dtype) -> None:
    tokens = 5
    cos, sin = (t.to(DEVICE) for t in _rotary_table(head_dim, 64, 10000.0, {}))
    qkv = _rand(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    positions = torch.tensor([0, 3, 17, 63, 3], dtype=index_dtype, device=DEVICE)
    want_q, want_k = rotary_torch(q.clone(), k.clone(), cos, sin, positions.long())
    bounds = [_rounding_bound(x, cos, sin, positions.long()) for x in (q, k)]
    te.rotary_embedding(q, k, cos, sin, positions)
    for got, want, bound in zip((q, k), (want_q, want_k), bounds):
        if dtype == torch.float32:
            _close(got, want)
        else:  # a 16-bit result: within the rounding of its products and their sum
            diff = (got.float() - want.float()).abs()
            assert (diff <= bound).all(), f"max diff {diff.max().item()}"
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v untouched


def _rounding_bound(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    positions: torch.Tensor) -> torch.Tensor:
    """How far two ways of rounding ``x1·cos - x2·sin`` (and ``x2·cos + x1·sin``) in ``x``'s
    16-bit dtype may fall apart: four units of the dtype's epsilon times ``|x1·cos| +
    |x2·sin|``. Torch's ops round each product and the sum; the kernel asks for the same
    roundings, but the compiled GPU code and Triton's interpreter (which truncates to bfloat16)
    have each been seen a unit or two away from torch's. A wrong angle, position or half is
    off by the size of ``x`` itself."""
    eps = torch.finfo(x.dtype).eps
    c, s = cos[positions].abs()[:, None, :], sin[positions].abs()[:, None, :]
    a = x.float().abs()
    half = a.shape[-1] // 2
    swapped = torch.cat([a[..., half:], a[..., :half]], dim=-1)
    return 4 * eps * (a * c + swapped * s)



def test_empty_batches() -> None:
    x = _rand(0, 64, dtype=torch.bfloat16)
    w = _rand(64, dtype=torch.bfloat16)
    assert te.rms_norm(x, w, 1e-6).shape == (0, 64)
    assert te.silu_and_mul(_rand(0, 128, dtype=torch.bfloat16)).shape == (0, 64)


def test_bad_layouts_are_refused() -> None:
    x = _rand(4, 64, dtype=torch.float32)
    with pytest.raises(ValueError, match="contiguous"):
        te.rms_norm(x.t(), _rand(4, dtype=torch.float32), 1e-6)
    with pytest.raises(ValueError, match="delta"):
        te.add_rms_norm(x, x[:2], _rand(64, dtype=torch.float32), 1e-6)


# ---------------------------------------------------------------------------------------------
# a decode step's launches, counted in the interpreter
# ---------------------------------------------------------------------------------------------
# aten ops that allocate or re-view memory: no kernel of their own on a GPU
NOT_KERNELS = {"aten.view", "aten.reshape", "aten._unsafe_view", "aten.empty",
               "aten.empty_like", "aten.empty_strided", "aten.promote_types", "aten.slice",
               "aten.split_with_sizes", "aten.split", "aten.select", "aten.t",
               "aten.as_strided", "aten.expand", "aten.unsqueeze", "aten.detach",
               "aten.alias", "aten.transpose", "aten.permute", "aten.squeeze"}
KERNELS_PER_LAYER = 10  # two norms, rotary, cache write, attention, SiLU·up, four GEMMs


def _count_decode_step(model_dir: Path, fused: bool,
                       monkeypatch: pytest.MonkeyPatch) -> tuple[int, torch.Tensor, int]:
    """Kernels one decode forward launches on the GPU's paths (Triton attention and, if
    ``fused``, the Triton element-wise kernels), run in the interpreter on the CPU: Triton
    launches plus the aten ops between them that are kernels. Also the hidden states."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.interpreter import InterpretedFunction

    from bench.decode_timing import decode_inputs
    from tidal.core import LLM
    from tidal.gpu import layers
    from tidal.gpu.cpu import selector

    selector.set_mode("off")  # the GPU has no compiled CPU kernels
    monkeypatch.setattr(layers, "TRITON_ON_CPU", fused)
    llm = LLM(str(model_dir), device="cpu", dtype="float32", attention_backend="triton",
              max_model_len=128, max_num_seqs=4, kv_cache_memory=4 << 20)
    runner = llm.engine.executor.runner
    ids, positions, meta = decode_inputs(runner, 2, 40)
    torch.manual_seed(0)
    for cache in runner.kv_caches:  # the context the step attends to: alike for both runs
        for tensor in cache:
            tensor.normal_()
    ids = torch.arange(2) + 7
    counts = {"triton": 0, "aten": 0}
    inside = [0]
    run = InterpretedFunction.run

    def counted_run(self: object, *args: object, **kwargs: object) -> object:
        counts["triton"] += 1
        inside[0] += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            inside[0] -= 1

    class CountOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore
            if not inside[0] and str(func.overloadpacket) not in NOT_KERNELS:
                counts["aten"] += 1
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(InterpretedFunction, "run", counted_run)
    with torch.inference_mode(), CountOps():
        hidden = runner.model(ids, positions, runner.kv_caches, meta)
    return counts["triton"] + counts["aten"], hidden, runner.model.config.num_layers


@pytest.mark.cpu_only(reason="counts launches in Triton's interpreter (the GPU check's kernel "
                      "profile counts the GPU's own)")
def test_decode_step_is_a_handful_of_kernels_per_layer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.model_shapes import build_shaped_model_dir

    model_dir = build_shaped_model_dir(tmp_path / "model", "qwen2.5-0.5b", tiny=True,
                                       dtype=torch.float32)
    fused, hidden, layers = _count_decode_step(model_dir, True, monkeypatch)
    unfused, want, _ = _count_decode_step(model_dir, False, monkeypatch)
    # the embedding, the final norm and per layer the kernels above
    print(f"kernels in one decode step of {layers} layers: {fused} fused, {unfused} unfused")
    assert fused <= KERNELS_PER_LAYER * layers + 2, (fused, layers)
    assert unfused > 2 * fused
    torch.testing.assert_close(hidden, want, rtol=1e-4, atol=1e-4)


@pytest.mark.cpu_only(reason="which kernels a CPU tensor gets in the interpreter")
def test_the_switch_keeps_torch_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    """``TIDAL_GPU_KERNELS=off`` (``layers.GPU_KERNELS``) gives the torch forms."""
    from tidal.gpu import layers

    x = _rand(2, 64, dtype=torch.float32)
    monkeypatch.setattr(layers, "TRITON_ON_CPU", True)
    assert layers.fused_kernels_for(x) is te
    monkeypatch.setattr(layers, "GPU_KERNELS", False)
    assert layers.fused_kernels_for(x) is None
