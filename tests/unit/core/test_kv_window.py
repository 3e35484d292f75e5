"""The sliding-window block group (core/kv_window.py): a request advancing far past its window
holds a bounded number of window blocks, counted from the window pool, while the full group
keeps its whole history; prefix hits are taken only where the window's blocks are cached."""

from __future__ import annotations

import pytest

from tidal.core.kv_cache_manager import KVCacheManager
from tidal.core.kv_window import NULL_BLOCK_ID, WindowGroup, window_group
from tidal.core.request import Request
from tidal.core.sampling_params import SamplingParams

BS, WINDOW = 4, 10


def _group(max_num_seqs: int = 2, max_chunk: int = 8) -> WindowGroup:
    group = window_group([WINDOW, 0, WINDOW], BS, 512, max_num_seqs, max_chunk, tier=False)
    assert group is not None
    return group


def _request(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=200))


def _advance(kv: KVCacheManager, request: Request, n: int) -> None:
    """Schedule ``n`` tokens as the scheduler does (allocating only when out of room)."""
    if not kv.has_room(request, n):
        assert kv.allocate_slots(request, n) is not None
    request.num_computed_tokens += n


def test_which_models_split_their_cache():
    assert window_group([0, 0], BS, 512, 2, 8, tier=False) is None  # no sliding layer
    assert window_group([WINDOW, WINDOW], BS, 512, 2, 8, tier=False) is None  # no full layer
    assert window_group([WINDOW, 0], BS, 512, 2, 8, tier=True) is None  # the KV tier
    assert window_group([WINDOW, 0], BS, 512, 2, 8, tier=False, stages=2) is None
    assert window_group([WINDOW, 0], BS, 16, 2, 8, tier=False) is None  # window ~ context
    # a window of 10 and chunks of 8 reach over 17 positions: five blocks, and one more
    assert _group().seat_blocks == 6


def test_decoding_past_the_window_holds_a_bounded_number_of_window_blocks():
    group = _group(max_chunk=8)
    kv = KVCacheManager(64, BS, window=group)
    assert kv.window is not None
    request = _request("a", list(range(20)))
    _advance(kv, request, 8)  # chunked prefill
    _advance(kv, request, 8)
    _advance(kv, request, 4)
    most = 0
    for token in range(130):  # decode far past the window
        request.append_output_token(token)
        _advance(kv, request, 1)
        table = kv.window.tables["a"]
        ids = [b.block_id for b in table]
        num_null = ids.count(NULL_BLOCK_ID)
        assert ids[:num_null] == [NULL_BLOCK_ID] * num_null  # those left behind, oldest first
        # every block the last token attended to is held (given back only once behind it)
        assert num_null <= max(0, request.num_computed_tokens - WINDOW) // BS
        assert len(table) == len(kv.req_blocks["a"])  # one logical index for both groups
        most = max(most, kv.window.num_held())
    assert most <= group.seat_blocks and num_null > 25
    assert kv.pool.num_blocks - kv.pool.num_free_blocks == -(-150 // BS)  # the whole history
    kv.free(request)
    assert kv.window.num_held() == 0 and kv.pool.num_free_blocks == 64


def test_new_window_blocks_are_reported_once_per_step():
    kv = KVCacheManager(64, BS, window=_group())
    request = _request("a", list(range(10)))
    _advance(kv, request, 8)
    assert kv.take_new_window_block_ids() == {"a": kv.window.block_ids("a")}
    assert kv.take_new_window_block_ids() == {}
    _advance(kv, request, 2)
    added = kv.take_new_window_block_ids()["a"]
    assert added == kv.window.block_ids("a")[-1:] and NULL_BLOCK_ID not in added


def test_prefix_hit_needs_the_windows_blocks_still_cached():
    kv = KVCacheManager(64, BS, window=_group())
    tokens = list(range(40))
    first = _request("a", tokens)
    for _ in range(5):
        _advance(kv, first, 8)
    kv.free(first)
    second = _request("b", tokens)
    hits, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 36 and len(hits) == 9  # the last block's window is all cached
    assert kv.allocate_slots(second, 4, hits, num_hit) is not None
    table = kv.window.tables["b"]
    first_needed = kv.window.first_needed(36)
    assert [b.block_id for b in table[:first_needed]] == [NULL_BLOCK_ID] * first_needed
    assert all(b.block_hash is not None for b in table[first_needed:9])
    kv.free(second)
    # evict the window blocks of positions 24..35: no hit may end past them any more
    for h in second.block_hashes[6:9]:
        block = kv.window.pool.get_cached_block(h)
        assert block is not None
        kv.window.pool._evict(block)
    third = _request("c", tokens)
    hits, num_hit = kv.get_computed_blocks(third)
    assert num_hit == 24 and len(hits) == 6


@pytest.mark.parametrize("num_full", [1, 10, 1000])
def test_the_split_fits_the_budget(num_full):
    group = _group(max_num_seqs=4)
    full_bytes, window_bytes = 300, 500  # a full block, a window block
    budget = num_full * (full_bytes + window_bytes)  # what the dense cache would hold
    n = group.full_blocks(budget, full_bytes, window_bytes)
    assert n * full_bytes + group.pool_blocks(n) * window_bytes <= budget
    assert n >= num_full - 1  # never fewer than the dense cache's blocks (the null one aside)
