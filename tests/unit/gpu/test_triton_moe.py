"""The Triton fused-MoE kernels (``gpu/moe_triton.py``) against the token-by-token loop of
``gpu/moe.py``: one token, many, experts no token chose, widths that are no multiple of the
tiles, float32 and bfloat16; and a MoE layer on the Triton path equal to its grouped path.

Without CUDA they run in Triton's interpreter on small shapes; on a GPU (``TIDAL_TEST_DEVICE``,
else CUDA where there is one) the kernels are compiled and run."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from tests.device import KERNEL_TEST_DEVICE  # noqa: E402
from tidal.gpu import layers  # noqa: E402
from tidal.gpu.moe import MoE, Routing, moe_reference, moe_triton, route  # noqa: E402
from tidal.gpu.moe_triton import BLOCK_M, align_blocks  # noqa: E402

pytestmark = pytest.mark.gpu

E, H, INTER = 8, 80, 48  # hidden and intermediate not multiples of the 64-wide tiles


def _case(tokens: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, 2 * INTER, H, generator=g) * 0.2
    down = torch.randn(E, H, INTER, generator=g) * 0.2
    x = torch.randn(tokens, H, generator=g)
    logits = torch.randn(tokens, E, generator=g)
    logits[:, [0, 2, 6]] = -30.0  # three experts no token chooses
    return [t.to(dtype).to(KERNEL_TEST_DEVICE) for t in (x, gate_up, down)], logits


def test_blocks_hold_each_experts_pairs_in_order():
    ids = torch.tensor([[3, 1], [1, 5], [3, 1]])
    pair_of_row, expert_of_block = align_blocks(ids, E)
    assert expert_of_block.tolist()[:3] == [1, 3, 5] and set(expert_of_block.tolist()[3:]) == {-1}
    rows = pair_of_row.view(-1, BLOCK_M)
    assert rows[0, :3].tolist() == [1, 2, 5] and rows[1, :2].tolist() == [0, 4]
    assert rows[2, :1].tolist() == [3] and (pair_of_row == 6).sum() == pair_of_row.numel() - 6


@pytest.mark.parametrize("routing", [Routing(2, True), Routing(3, False, float32_weights=True)])
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_kernels_equal_the_token_loop_in_float32(routing, tokens):
    (x, gate_up, down), logits = _case(tokens, torch.float32, seed=tokens)
    weights, ids = route(logits.to(x.device), routing)
    got = moe_triton(x, gate_up, down, weights, ids, routing)
    want = moe_reference(x, gate_up, down, weights, ids, routing)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_kernels_in_bfloat16_stay_near_the_float32_loop():
    routing = Routing(2, True)
    (x, gate_up, down), logits = _case(24, torch.bfloat16, seed=3)
    weights, ids = route(logits.to(x.device), routing)
    got = moe_triton(x, gate_up, down, weights, ids, routing).float()
    want = moe_reference(x.float(), gate_up.float(), down.float(), weights, ids, routing)
    torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)


def test_layer_takes_the_triton_path_and_matches_its_grouped_path(monkeypatch):
    monkeypatch.setattr(layers, "TRITON_ON_CPU", True)
    layer = MoE(H, INTER, E, Routing(2, True)).to(KERNEL_TEST_DEVICE)
    (x, gate_up, down), _ = _case(9, torch.float32, seed=5)
    with torch.no_grad():
        layer.experts.gate_up_proj.copy_(gate_up)
        layer.experts.down_proj.copy_(down)
        from tidal.gpu import moe

        calls = []
        monkeypatch.setattr(moe, "moe_triton", lambda *a: calls.append(1) or moe_triton(*a))
        got = layer(x)
        want = layer.run(x, moe.moe_grouped)
    assert calls == [1]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
