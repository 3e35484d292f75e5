"""The sampler's draw (inverse transform): frequencies follow the weights, tokens of weight 0
are never drawn (a uniform at its largest included), and a seeded row draws the same whatever
the rows beside it."""

from __future__ import annotations

import pytest
import torch

from tests.device import KERNEL_TEST_DEVICE
from tidal.gpu.sampler import draw
from tidal.gpu.sampling_metadata import RandomRows


def _rows(n: int, generators: dict[int, torch.Generator] | None = None) -> RandomRows:
    return RandomRows(rows=torch.arange(n), temperature=torch.ones(n), top_k=None, top_p=None,
                      min_p=None, generators=generators or {}, all_rows=True)


@pytest.mark.gpu
def test_draws_follow_unnormalised_probabilities() -> None:
    """Rows of weights summing to 2 (as after the verifier takes a draft out): frequencies
    within 0.01 of the weights' shares (total variation), zero-weight tokens never drawn."""
    weights = torch.tensor([1.0, 0.0, 0.4, 0.6, 0.0, 0.0, 1e-3, 0.0], device=KERNEL_TEST_DEVICE)
    n = 100_000
    torch.manual_seed(3)
    counts = torch.bincount(draw(weights.repeat(n, 1), _rows(n)), minlength=8).cpu().double()
    expected = (weights / weights.sum()).cpu().double()
    assert 0.5 * (counts / n - expected).abs().sum() < 0.01, counts
    assert counts[[1, 4, 5, 7]].sum() == 0


def test_a_uniform_at_its_largest_still_draws_a_token_with_probability(monkeypatch) -> None:
    """u just below 1 times the total can round up to the total: the draw stays on the last
    token whose probability is above 0, not on the zeros after it or past the vocabulary."""
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **k: real_rand(*a, **k).fill_(1 - 2**-53))
    weights = torch.tensor([[0.3, 0.7, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3, 0.0]])
    assert draw(weights, _rows(2)).tolist() == [1, 2]


def test_seeded_draws_replay_whatever_the_rows_beside() -> None:
    weights = torch.rand(6, 50)
    first = draw(weights, _rows(6, {2: torch.Generator().manual_seed(5)}))
    again = draw(weights[1:4], _rows(3, {1: torch.Generator().manual_seed(5)}))
    assert first[2] == again[1]
