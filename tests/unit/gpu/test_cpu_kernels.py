"""The compiled CPU kernels: fused RMSNorm and rotary embeddings against their torch forms, and
denormals flushed on the whole torch pool."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tidal.gpu import layers, sampler
from tidal.gpu.cpu.kernels import load_cpu_kernels
from tidal.gpu.sampler import row_argmax

# A fresh interpreter, whose worker threads have never been flushed.
SCRIPT = """
import torch
from tidal.gpu.cpu.kernels import denormals_flushed, load_cpu_kernels
torch.set_num_threads(2)
tiny, scale = torch.full((1 << 20,), 1e-30), torch.full((1 << 20,), 1e-10)
before = int(((tiny * scale) == 0).sum())
with denormals_flushed():
    inside = int(((tiny * scale) == 0).sum())
    normal_kept = bool((torch.full((8,), 1e-20) * 1e-10 != 0).all())
after = 1e-300 * 1e-10 != 0.0  # Python's own floats on this thread, unflushed again
load_cpu_kernels().flush_denormals_in_pool()  # as the runner does when its threads change
after_pool = 1e-300 * 1e-10 != 0.0
torch.set_flush_denormal(True)  # a caller's own choice survives the block
with denormals_flushed():
    pass
kept_flushed = 1e-300 * 1e-10 == 0.0
print(before, inside, normal_kept, after, kept_flushed, after_pool)
"""


def test_denormals_flushed_on_every_worker_and_restored_on_the_caller():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         check=True).stdout.split()
    assert int(out[0]) == 0  # 1e-40 is a denormal, kept by default
    assert int(out[1]) == 1 << 20  # a multiply split across the pool: every share flushed
    assert out[2] == "True"  # 1e-30 is a normal float: untouched
    assert out[3] == "True"  # the calling thread keeps IEEE denormals outside the block
    assert out[4] == "True"  # and a caller that flushed before stays flushed
    assert out[5] == "True"  # flushing the pool's workers leaves the caller's floats alone


@pytest.fixture
def torch_forms(monkeypatch):
    """Calls the layers' plain torch forms, with the kernels switched off."""
    def run(fn):
        with monkeypatch.context() as patch:
            patch.setattr(layers, "cpu_kernels_for", lambda x, plan=None: None)
            return fn()
    return run


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_rms_norm_kernel_matches_the_torch_form(torch_forms, dtype, tol):
    torch.manual_seed(0)
    norm = layers.RMSNorm(96, 1e-6).to(dtype)
    norm.weight.data = torch.randn(96).to(dtype)
    x = (torch.randn(37, 96) * 3).to(dtype)
    assert load_cpu_kernels() is not None
    got = norm(x)
    expected = torch_forms(lambda: norm(x))
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_add_and_norm_kernel_matches_the_torch_form(torch_forms, dtype, tol):
    """The sum is rounded to the dtype before it is normalised, as a separate add leaves it."""
    torch.manual_seed(3)
    norm = layers.RMSNorm(96, 1e-6).to(dtype)
    norm.weight.data = torch.randn(96).to(dtype)
    x, delta = ((torch.randn(2, 19, 96) * 3).to(dtype) for _ in range(2))
    got_sum, got = norm.add_and_norm(x, delta)
    expected_sum, expected = torch_forms(lambda: norm.add_and_norm(x, delta))
    torch.testing.assert_close(got_sum, expected_sum, rtol=0, atol=0)
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)
    with pytest.raises(RuntimeError, match="delta must be"):
        load_cpu_kernels().add_rms_norm(x, delta[:, :5], norm.weight, 1e-6)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_rotary_kernel_rotates_strided_views_in_place(torch_forms, dtype, tol):
    """q and k as views into one fused projection, as the attention layer makes them."""
    torch.manual_seed(1)
    rope = layers.RotaryEmbedding(64, 512, 10000.0)
    qkv = torch.randn(9, (4 + 2 + 2) * 64).to(dtype)
    positions = torch.tensor([0, 1, 2, 100, 101, 300, 5, 511, 7])

    def views(t):
        q, k, _ = t.split([4 * 64, 2 * 64, 2 * 64], dim=-1)
        return q.view(9, 4, 64), k.view(9, 2, 64)

    expected_q, expected_k = torch_forms(lambda: rope(positions, *views(qkv.clone())))
    fused = qkv.clone()
    got_q, got_k = rope(positions, *views(fused))
    torch.testing.assert_close(got_q.float(), expected_q.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got_k.float(), expected_k.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(fused[:, 6 * 64:], qkv[:, 6 * 64:])  # v untouched
    with pytest.raises(RuntimeError, match="out of range"):
        rope(torch.tensor([512] * 9), *views(fused))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3),
                                       (torch.float16, 1e-3)])
@pytest.mark.parametrize("width", [1408, 37])  # 37: lanes past the last whole vector
def test_silu_and_mul_kernel_matches_the_torch_form(torch_forms, dtype, tol, width):
    torch.manual_seed(2)
    gate_up = (torch.randn(2, 5, 2 * width) * 6).to(dtype)
    gate_up[0, 0, :8] = torch.tensor([0.0, -0.0, 1e-3, -1e-3, 30.0, -30.0, 200.0, -200.0])
    assert load_cpu_kernels() is not None
    got = layers.silu_and_mul(gate_up)
    expected = torch_forms(lambda: layers.silu_and_mul(gate_up))
    assert got.dtype == dtype and got.shape == (2, 5, width)
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=1e-6)


def test_silu_and_mul_kernel_keeps_infinities_and_nans():
    gate = torch.tensor([float("inf"), float("-inf"), float("nan"), 2.0] * 4)
    up = torch.tensor([2.0, 3.0, 1.0, float("nan")] * 4)
    for dtype in (torch.float32, torch.bfloat16):
        got = load_cpu_kernels().silu_and_mul(torch.cat([gate, up]).to(dtype)).float()
        expected = (torch.nn.functional.silu(gate.to(dtype)) * up.to(dtype)).float()
        torch.testing.assert_close(got, expected, equal_nan=True)


@pytest.mark.parametrize("width", [8192, 50257, 7, 16])  # whole vectors, a tail, < and = 16
def test_row_argmax_kernel_matches_torch_max(width):
    """The compiled kernel against torch's max(dim=-1) (first maximum, first NaN), on rows of
    random values, ties, -inf rows, NaN and a strided (sliced) batch."""
    assert load_cpu_kernels() is not None
    torch.manual_seed(width)
    x = torch.randn(9, width + 3)[:, :width]  # rows 3 floats apart beyond their width
    x[1] = float("-inf")
    x[2, width // 2] = x[2, width - 1] = x[2, 0] = 50.0  # a tie: index 0 wins
    x[3, width - 1] = 60.0  # the maximum in the last element (the tail when there is one)
    x[4, width // 3] = float("nan")
    x[5, width - 1] = float("nan")
    x[5, 0] = 70.0
    x[6] = 0.0
    x[7, width // 2] = float("inf")
    got = load_cpu_kernels().argmax_rows(x)
    assert torch.equal(got, x.max(dim=-1).indices)


def test_row_argmax_takes_the_kernel_for_float32_rows_only(monkeypatch):
    kernels, calls = load_cpu_kernels(), []

    class Recording:
        def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(tuple(x.shape))
            return kernels.argmax_rows(x)

    monkeypatch.setattr(sampler, "load_cpu_kernels", lambda: Recording())
    x = torch.randn(4, 100)
    assert torch.equal(row_argmax(x), x.max(dim=-1).indices) and calls == [(4, 100)]
    for other in (x.double(), x.t()):  # another dtype, rows that are not contiguous
        assert torch.equal(row_argmax(other), other.max(dim=-1).indices)
    assert calls == [(4, 100)]


def test_decode_inputs_match_the_paged_layout():
    """Each request's input id, position, slot (``block_table[row, p // bs] * bs + p % bs``),
    length and block-table row, as the metadata's docstring lays them out."""
    g = torch.Generator().manual_seed(3)
    token_ids = torch.randint(0, 1000, (8, 64), generator=g)
    block_table = torch.randint(0, 500, (8, 16), generator=g, dtype=torch.int32)
    rows, positions, bs = [5, 0, 7, 2], [0, 15, 16, 63], 4
    columns = -(-(max(positions) + 1) // bs)
    ids, pos, slots, lens, starts, table = load_cpu_kernels().decode_inputs(
        rows, positions, token_ids, block_table, bs, columns)
    r, p = torch.tensor(rows), torch.tensor(positions)
    assert torch.equal(ids, token_ids[r, p]) and torch.equal(pos, p)
    assert torch.equal(slots, block_table[r, p // bs].long() * bs + p % bs)
    assert lens.dtype == starts.dtype == table.dtype == torch.int32
    assert lens.tolist() == [q + 1 for q in positions] and starts.tolist() == [0, 1, 2, 3, 4]
    assert torch.equal(table, block_table[r, :columns])
    with pytest.raises(RuntimeError, match="outside the batch"):
        load_cpu_kernels().decode_inputs([8], [0], token_ids, block_table, bs, 1)


def test_parallel_items_gives_a_held_up_threads_share_to_the_others():
    """The split under the GEMM and decode attention: every item is done exactly once, and a
    thread held up mid-region (here asleep on its first item) keeps only that item; the rest
    of its share goes to the threads that are free."""
    probe, threads = load_cpu_kernels().parallel_items_probe, torch.get_num_threads()
    owner, times = probe(64, 1, -1, 0).unbind(1)  # items of 1 ms, no thread held up
    assert torch.equal(times, torch.ones(64, dtype=torch.long))
    assert set(owner.tolist()) == set(range(min(threads, 64)))
    owner, times = probe(64, 1, 1, 1000).unbind(1)  # thread 1 held 1 s on its first item
    assert torch.equal(times, torch.ones(64, dtype=torch.long))
    if threads >= 2:
        assert int((owner == 1).sum()) == 1
