from tidal.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock, hash_block_tokens
from tidal.core.kv_cache_manager import KVCacheManager
from tidal.core.request import Request
from tidal.core.sampling_params import SamplingParams


def _request(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=4))


def test_free_queue_removes_from_the_middle_in_constant_time():
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert queue.num_free == 3
    assert [queue.popleft().block_id for _ in range(3)] == [0, 1, 3]


def test_chained_hash_depends_on_the_whole_prefix():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(a, [5, 6]) != hash_block_tokens(hash_block_tokens(None, [9]), [5, 6])
    assert hash_block_tokens(None, [1, 2, 3, 4]) == a


def test_prefix_hit_reuses_blocks_and_is_capped_below_the_prompt_length():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first = _request("a", list(range(12)))
    assert kv.allocate_slots(first, 12) is not None
    kv.free(first)
    same = _request("b", list(range(12)))
    hits, num_hit = kv.get_computed_blocks(same)
    assert num_hit == 8  # 3 full blocks cached, but one token must be left to compute
    assert len(hits) == 2
    longer = _request("c", list(range(13)))
    assert kv.get_computed_blocks(longer)[1] == 12
    assert kv.stats.hits == 20 and kv.stats.queries == 25


def test_freed_blocks_are_evicted_tail_first_and_lru():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    for i, b in enumerate(blocks):
        pool.cache_block(b, bytes([i]))
    pool.free_blocks(reversed(blocks))  # tail first
    assert pool.get_new_blocks(1)[0] is blocks[3]
    assert pool.get_cached_block(bytes([3])) is None  # evicted on reuse
    assert pool.get_cached_block(bytes([0])) is blocks[0]


def test_allocation_fails_cleanly_when_the_pool_is_short():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    req = _request("a", list(range(12)))
    assert kv.allocate_slots(req, 12) is None
    assert kv.pool.num_free_blocks == 2 and "a" not in kv.req_blocks


def test_shared_prefix_blocks_are_reference_counted():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = _request("a", list(range(9)))
    kv.allocate_slots(a, 9)
    b = _request("b", list(range(8)) + [99])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    kv.allocate_slots(b, 1, hits, num_hit)
    assert [blk.ref_cnt for blk in hits] == [2, 2]
    kv.free(a)
    kv.free(b)
    assert all(blk.ref_cnt == 0 for blk in kv.pool.blocks)
    assert kv.pool.num_free_blocks == 6


def test_a_block_filled_by_decoded_tokens_is_cached_once_full():
    """Most decode steps allocate nothing; the step that computes a block's last position
    registers the block, and the step past a block's end allocates the next one."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = _request("a", list(range(6)))
    kv.allocate_slots(req, 6)
    req.num_computed_tokens = 6
    for position, token in ((6, 100), (7, 101)):
        req.append_output_token(token)
        # position 7 fills the second block: the scheduler must call allocate_slots for it
        assert kv.has_room(req, 1) == (position == 6)
        assert kv.allocate_slots(req, 1) == []  # room in the second block
        req.num_computed_tokens = position + 1
        assert kv.num_cached_blocks["a"] == (1 if position == 6 else 2)
    req.append_output_token(102)
    assert not kv.has_room(req, 1)
    assert len(kv.allocate_slots(req, 1)) == 1  # position 8 starts a third block
    kv.free(req)
    again = _request("b", [*range(6), 100, 101, 5])
    assert kv.get_computed_blocks(again)[1] == 8
