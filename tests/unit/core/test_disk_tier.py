"""The second tier's disk part (core/host_tier.py, gpu/kv_disk_tier.py) and the choice between
swapping a preempted request's blocks back and recomputing them (core/swap_policy.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.device import TEST_DEVICE
from tidal.app.metrics import ServerMetrics
from tidal.core.block_pool import hash_block_tokens
from tidal.core.host_tier import HostTier, TierHit
from tidal.core.llm import LLM
from tidal.core.sampling_params import SamplingParams
from tidal.core.swap_policy import SwapPolicy
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.random_model import build_model_dir

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)


def _blocks(path: Path, blocks: int) -> int:
    """The cache memory of ``blocks`` float32 blocks (the tests name their dtype: a GPU
    engine would default to bfloat16, twice the blocks)."""
    return blocks * 16 * ModelConfig.from_dir(path).kv_bytes_per_token(4)


def _prompt(seed: int, n: int = 48) -> list[int]:
    return [(seed * 37 + i * 11) % 500 + 3 for i in range(n)]


def _same_outputs(got, want) -> None:
    assert got.token_ids == want.token_ids
    for g, w in zip(got.logprobs, want.logprobs):
        assert g.keys() == w.keys()
        for token, value in w.items():
            assert g[token] == pytest.approx(value, abs=1e-4)


def test_host_evictions_spill_to_disk_and_come_back_from_it():
    tier = HostTier(1, disk_blocks=2)
    tier.store(b"a", device_block=5)
    tier.take_copies()
    tier.store(b"b", device_block=6)  # a leaves its host slot for disk slot 0, first
    copies = tier.take_copies()
    assert copies.to_disk == [(0, 0, b"a")] and copies.out == [(6, 0)]
    hit = tier.lookup(b"a")
    assert hit == TierHit("disk", 0) and tier.lookup(b"b") == TierHit("host", 0)
    tier.reserve([hit])
    # a is promoted: read into the host slot (b leaving it for disk slot 1: slot 0 is read
    # this step), then copied in from there; it stays on disk too
    tier.load_hit(hit, device_block=7)
    tier.store(b"c", device_block=8)  # host and disk slots all busy this step: dropped
    copies = tier.take_copies()
    assert copies.to_disk == [(0, 1, b"b")] and copies.promote == [(0, 0)]
    assert copies.into == [(0, 7)] and copies.from_disk == [] and copies.out == []
    assert tier.stats.disk_hits == tier.stats.promoted == 1 and tier.stats.dropped == 1
    assert tier.lookup(b"a") == TierHit("host", 0) and tier.lookup(b"b") == TierHit("disk", 1)
    assert tier.num_used_disk == 2
    tier.store(b"a", device_block=7)  # evicted from the device again: host holds it already
    assert tier.take_copies() is None
    tier.clear()
    assert tier.take_copies().clear_disk and tier.lookup(b"a") is None


def test_the_measured_cheaper_way_back_is_chosen():
    policy = SwapPolicy()
    assert policy.swap(2, 0, 16), "unmeasured: copy, which measures the copies"
    policy.record_prefill(100, 0.1)  # 1 ms a token
    policy.record_copies({"host": (4, 0.004)})  # 1 ms a block of 16 tokens
    assert policy.swap(2, 0, 16)
    assert policy.swap(0, 1, 16), "the disk's copies are not measured yet"
    policy.record_copies({"disk": (1, 1.0)})  # a second a block: slower than 16 tokens
    assert not policy.swap(2, 1, 16) and policy.swap(2, 0, 16)
    costs = policy.costs(16)  # per token: a disk block is read, then copied in from host
    assert costs == pytest.approx({"swap_host": 0.001 / 16, "swap_disk": 1.001 / 16,
                                   "recompute": 0.001})


@pytest.mark.gpu
def test_a_restarted_engine_finds_its_prefixes_on_disk(tmp_path: Path) -> None:
    """Eight device blocks and two host ones: A's prompt blocks are pushed out to disk by B, C
    and D, and D's, still on the device, go there at shutdown. A second engine on the same
    path finds both there (greedy tokens and logprobs as their cold prefills); one serving
    another model, or under a changed manifest, finds nothing."""
    path = build_model_dir(tmp_path / "llama", "llama")
    cache = tmp_path / "kv"
    with pytest.raises(ValueError, match="kv_offload_size"):
        LLM(str(path), kv_offload_path=str(cache))  # a disk needs the host part in front
    tiers = dict(device=TEST_DEVICE, dtype="float32", kv_cache_memory=_blocks(path, 8),
                 kv_offload_size=_blocks(path, 2), kv_offload_path=str(cache),
                 kv_offload_disk_size=_blocks(path, 40), max_num_seqs=1)
    first = LLM(str(path), **tiers)
    cold = [first.generate(_prompt(seed), GREEDY, use_tqdm=False)[0] for seed in (1, 2, 3, 4)]
    evicted = first.engine.stats().disk_tier_stored
    first.shutdown()  # which leaves the host tier's blocks and the device's on disk too
    stored = first.engine.kv.host.stats.disk_stored
    assert evicted >= 2 and stored > evicted

    again = LLM(str(path), **tiers)
    host = again.engine.kv.host
    assert host is not None and host.stats.disk_loaded == stored
    warm = again.generate(_prompt(1), GREEDY, use_tqdm=False)[0]
    assert warm.num_cached_tokens == 32, "two of A's three blocks came back from disk"
    assert again.engine.stats().disk_tier_hits == 2
    metrics = ServerMetrics(again.engine.stats).render().decode()
    assert "tidal:kv_disk_tier_hits_total 2.0" in metrics
    assert f'tidal:kv_disk_tier_blocks{{state="used"}} {float(stored)}' in metrics
    _same_outputs(warm.outputs[0], cold[0].outputs[0])
    latest = again.generate(_prompt(4), GREEDY, use_tqdm=False)[0]
    assert latest.num_cached_tokens == 32, "D's blocks, on the device at shutdown, on disk"
    _same_outputs(latest.outputs[0], cold[3].outputs[0])
    again.shutdown()

    other = build_model_dir(tmp_path / "other", "llama", seed=1)
    stranger = LLM(str(other), **tiers)
    assert stranger.engine.kv.host.stats.disk_loaded == 0
    assert stranger.generate(_prompt(1), GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    stranger.shutdown()

    for manifest in cache.glob("*/manifest.json"):  # as if the tokenizer had changed
        meta = json.loads(manifest.read_text()) | {"tokenizer": "another"}
        manifest.write_text(json.dumps(meta, sort_keys=True))
    rejected = LLM(str(path), **tiers)
    assert rejected.engine.kv.host.stats.disk_loaded == 0
    rejected.shutdown()


@pytest.mark.gpu
def test_a_preempted_request_resumes_alike_by_swap_and_by_recompute(tmp_path: Path) -> None:
    """Three requests that outgrow six device blocks preempt one another; resumed by copying
    their blocks back from the host tier, or by computing them again, each gives the greedy
    tokens and logprobs of a run with room for all (no preemption)."""
    path = build_model_dir(tmp_path / "llama", "llama")
    prompts = [_prompt(seed, 20) for seed in (1, 2, 3)]
    params = SamplingParams(max_tokens=28, temperature=0.0, logprobs=2, ignore_eos=True)
    roomy = LLM(str(path), device=TEST_DEVICE, dtype="float32", kv_cache_memory=_blocks(path, 16))
    want = roomy.generate(prompts, params, use_tqdm=False)
    assert roomy.engine.stats().num_preemptions == 0
    for method in ("swap", "recompute"):
        llm = LLM(str(path), device=TEST_DEVICE, dtype="float32", kv_cache_memory=_blocks(path, 6),
                  kv_offload_size=_blocks(path, 16), max_num_seqs=3)
        llm.engine.kv.swap_policy.swap = lambda *_, m=method: m == "swap"
        got = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0
        assert stats.resumptions_by_method.get(method, 0) > 0
        assert (stats.host_tier_hits > 0) == (method == "swap")
        metrics = ServerMetrics(llm.engine.stats).render().decode()
        count = stats.resumptions_by_method[method]
        assert f'tidal:kv_resumptions_total{{method="{method}"}} {count}.0' in metrics
        assert f"tidal:kv_swapped_in_blocks_total {stats.host_tier_hits}.0" in metrics
        measured = {"recompute"} | ({"swap_host"} if method == "swap" else set())
        assert set(stats.resumption_cost_per_token) == measured  # what the choice compares
        for way in measured:
            assert f'tidal:kv_resumption_cost_seconds_per_token{{method="{way}"}}' in metrics
        for g, w in zip(got, want):
            _same_outputs(g.outputs[0], w.outputs[0])


def _no_block_leaked(llm: LLM) -> None:
    """Every device block free once nothing runs, every tier slot free or holding one block."""
    kv = llm.engine.kv
    assert not llm.engine.has_unfinished_requests()
    assert kv.pool.num_free_blocks == kv.num_blocks
    assert all(not b.ref_cnt for b in kv.pool.blocks)
    assert kv.host.leaked_slots() == {"host": set(), "disk": set()}


@pytest.mark.gpu
def test_a_disk_hit_is_promoted_so_the_next_hit_is_a_host_hit(tmp_path: Path) -> None:
    """A's blocks, left on disk by a first engine, are hit by a second one: read into host
    memory on the way in, so once B and C have pushed them off the device again, A's next hit
    finds them in host memory. Greedy tokens and logprobs equal A's cold prefill each time, and
    no block is left held in any tier."""
    path = build_model_dir(tmp_path / "llama", "llama")
    tiers = dict(device=TEST_DEVICE, dtype="float32", kv_cache_memory=_blocks(path, 8),
                 kv_offload_size=_blocks(path, 8), kv_offload_path=str(tmp_path / "kv"),
                 kv_offload_disk_size=_blocks(path, 40), max_num_seqs=1)
    first = LLM(str(path), **tiers)
    cold = first.generate(_prompt(1), GREEDY, use_tqdm=False)[0]
    first.shutdown()  # A's blocks go to disk

    llm = LLM(str(path), **tiers)
    host = llm.engine.kv.host
    assert host.num_used == 0 and host.num_used_disk > 0
    from_disk = llm.generate(_prompt(1), GREEDY, use_tqdm=False)[0]
    assert from_disk.num_cached_tokens == 32
    assert host.stats.disk_hits == host.stats.promoted == 2 and host.stats.hits == 0
    for seed in (2, 3):  # push A's blocks off the device
        llm.generate(_prompt(seed), GREEDY, use_tqdm=False)
    assert not any(llm.engine.kv.pool.get_cached_block(h) for h in _hashes(llm, _prompt(1)))
    from_host = llm.generate(_prompt(1), GREEDY, use_tqdm=False)[0]
    assert from_host.num_cached_tokens == 32
    assert host.stats.hits == 2 and host.stats.disk_hits == 2, "the second hit: host memory"
    _same_outputs(from_disk.outputs[0], cold.outputs[0])
    _same_outputs(from_host.outputs[0], cold.outputs[0])
    _no_block_leaked(llm)
    llm.shutdown()


def _hashes(llm: LLM, prompt: list[int]) -> list[bytes]:
    """The prefix-cache hashes of ``prompt``'s full blocks."""
    hashes: list[bytes] = []
    for i in range(len(prompt) // 16):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None,
                                        prompt[i * 16:(i + 1) * 16]))
    return hashes
