"""The KV cache's second tier (core/host_tier.py, gpu/kv_host_tier.py): prefix blocks the
device pool evicts are kept in host memory and copied back on a hit, giving the same tokens and
logprobs as computing them again."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.device import TEST_DEVICE
from tidal.core.host_tier import HostTier
from tidal.core.llm import LLM
from tidal.core.sampling_params import SamplingParams
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.random_model import build_model_dir


def test_slots_are_kept_least_recently_used_first():
    tier = HostTier(2)
    tier.store(b"a", device_block=5)
    tier.store(b"b", device_block=6)
    assert tier.find(b"a") == 0  # a is now the most recently used
    tier.take_copies()
    tier.store(b"c", device_block=7)  # takes b's slot
    assert tier.find(b"b") is None and tier.find(b"c") == 1 and tier.find(b"a") == 0
    copies = tier.take_copies()
    assert copies is not None and copies.out == [(7, 1)] and copies.into == []
    assert tier.take_copies() is None


def test_a_slot_read_this_step_is_not_handed_out_again():
    tier = HostTier(1)
    tier.store(b"a", device_block=3)
    tier.take_copies()
    tier.load(tier.find(b"a"), device_block=3)  # a's block comes back this step
    tier.store(b"b", device_block=4)  # no slot but a's, which this step reads: dropped
    copies = tier.take_copies()
    assert copies.into == [(0, 3)] and copies.out == []
    assert tier.stats.dropped == 1 and tier.find(b"a") == 0


def _blocks(path: Path, blocks: int) -> int:
    """The cache memory of ``blocks`` float32 blocks (the tests name their dtype: a GPU
    engine would default to bfloat16, twice the blocks)."""
    return blocks * 16 * ModelConfig.from_dir(path).kv_bytes_per_token(4)


@pytest.mark.gpu
def test_an_evicted_prefix_comes_back_from_the_host_tier(tmp_path: Path) -> None:
    """Eight device blocks: prompt A's blocks are evicted by B and C, then A again finds them
    in the host tier; its greedy tokens and logprobs equal A's first run, and without the tier
    A is computed again from scratch."""
    path = build_model_dir(tmp_path / "llama", "llama")
    prompts = {name: [(seed * 37 + i * 11) % 500 + 3 for i in range(48)]
               for seed, name in enumerate("ABC", start=1)}
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)
    runs = {}
    for offload in (0, _blocks(path, 20)):
        llm = LLM(str(path), device=TEST_DEVICE, dtype="float32", kv_cache_memory=_blocks(path, 8),
                  kv_offload_size=offload, max_num_seqs=1)
        outs = [llm.generate(prompts[name], params, use_tqdm=False)[0] for name in "ABCA"]
        runs[offload] = (outs, llm.engine.kv.host)
    (plain, no_tier), (tiered, tier) = runs.values()
    assert no_tier is None and tier is not None and tier.stats.stored > 0
    assert plain[3].num_cached_tokens == 0, "without the tier A was evicted"
    # two of A's three full prompt blocks: the last is computed again, for its logits
    assert tiered[3].num_cached_tokens == 32, "A's prefix came back from the host tier"
    assert tier.stats.hits == 2
    stats = llm.engine.stats()
    assert stats.host_tier_hits == 2 and stats.host_tier_used == tier.num_used > 0
    first, again = tiered[0].outputs[0], tiered[3].outputs[0]
    assert again.token_ids == first.token_ids == plain[3].outputs[0].token_ids
    for got, want in zip(again.logprobs, first.logprobs):
        assert got.keys() == want.keys()
        for token, value in want.items():
            assert got[token] == pytest.approx(value, abs=1e-5)
