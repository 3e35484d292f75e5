"""The sliding-window layers' KV blocks: a second block group with its own pool and tables.

A model whose layers are partly sliding-window (Gemma 2/3, gpt-oss) splits its KV cache in two
groups, as vLLM's hybrid KV cache manager does: the full-attention layers keep every block of a
request's history (``core/kv_cache_manager.py``'s pool), while the sliding-window layers have a
pool of their own, in which a request holds only the blocks its window still reaches. A block
wholly before ``num_computed_tokens - window + 1`` is given back as the request advances; its
place in the request's table is taken by the null block (id 0, never handed out), which the
attention kernels never read unmasked since they start each row at its window.

Both groups index a request's blocks by the same logical block number, so their tables have the
same length and grow at the same steps. Prefix caching in the window group follows vLLM's rule:
a hit is valid only if every block inside the window before the hit's end is still cached here;
the hit taken is the longest prefix that both groups can serve.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tidal.core.block_pool import BlockHash, BlockPool, KVCacheBlock

if TYPE_CHECKING:
    from tidal.core.config import EngineConfig

NULL_BLOCK_ID = 0


@dataclass(frozen=True)
class WindowGroup:
    """How the sliding-window layers' cache is laid out."""

    window: int  # the positions a sliding layer attends to (the row's own included)
    seat_blocks: int  # the most window blocks one request holds at once
    max_num_seqs: int

    def pool_blocks(self, num_full_blocks: int) -> int:
        """The window pool's blocks, the null block included. A request never holds more
        window blocks than full ones, so the full pool's count is always enough."""
        return min(self.max_num_seqs * self.seat_blocks, num_full_blocks) + 1

    def full_blocks(self, budget: int, full_block_bytes: int, window_block_bytes: int) -> int:
        """The full pool's blocks that ``budget`` bytes hold beside the window pool's
        ``pool_blocks`` (a block of each group costing what its layers take)."""
        seats = self.max_num_seqs * self.seat_blocks
        n = (budget - (seats + 1) * window_block_bytes) // full_block_bytes
        if n >= seats:  # every request's window fits beside them
            return n
        return (budget - window_block_bytes) // (full_block_bytes + window_block_bytes)


def single_window(layer_windows: Sequence[int]) -> int:
    """The window all sliding layers share; 0 where there is none (or they differ, which no
    supported model does: such a model keeps one group)."""
    windows = {w for w in layer_windows if w}
    return windows.pop() if len(windows) == 1 else 0


def window_group(layer_windows: Sequence[int], block_size: int, max_model_len: int,
                 max_num_seqs: int, max_chunk: int, tier: bool,
                 stages: int = 1) -> WindowGroup | None:
    """The window group of a model, or None when it keeps one group: no sliding layer, a
    window that covers the whole context anyway, a second KV tier (it copies every layer's
    block by one id), or pipeline stages (a stage may hold no full layer)."""
    window = single_window(layer_windows)
    if not window or tier or stages > 1 or all(layer_windows):
        return None
    # a step's n new tokens after c computed ones reach back to c - window + 1: a span of
    # window + n - 1 positions, over at most one block more than it fills
    seat = -(-(window + min(max_chunk, max_model_len) - 1) // block_size) + 1
    if seat >= -(-max_model_len // block_size):
        return None
    return WindowGroup(window, seat, max_num_seqs)


def window_group_for(config: EngineConfig, layer_windows: Sequence[int],
                     max_model_len: int) -> WindowGroup | None:
    """``window_group`` for an engine: the scheduler's side and the runner's agree on it."""
    assert config.max_num_batched_tokens is not None  # set by EngineConfig.__post_init__
    return window_group(layer_windows, config.block_size, max_model_len, config.max_num_seqs,
                        config.max_num_batched_tokens, tier=config.kv_offload_size > 0,
                        stages=config.pipeline_parallel_size)


class WindowBlocks:
    """Every request's sliding-window blocks: a table per request, indexed as the full
    group's, with the null block where a block has left the window."""

    def __init__(self, group: WindowGroup, num_blocks: int, block_size: int,
                 enable_caching: bool) -> None:
        self.window, self.block_size = group.window, block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.null = self.pool.get_new_blocks(1)[0]  # held forever: never handed out
        assert self.null.block_id == NULL_BLOCK_ID
        self.tables: dict[str, list[KVCacheBlock]] = {}
        self._hits: dict[str, list[KVCacheBlock]] = {}  # a waiting request's prefix hit
        self._added: dict[str, list[int]] = {}  # per request: ids added since ``take_added``

    def first_needed(self, num_computed: int) -> int:
        """The first block the next token (at position ``num_computed``) still attends to."""
        return max(0, num_computed - self.window + 1) // self.block_size

    def num_held(self) -> int:
        """Window blocks held by requests (the null block not counted)."""
        return self.pool.num_blocks - self.pool.num_free_blocks - 1

    def longest_hit(self, request_id: str, hashes: Sequence[BlockHash], num_full: int) -> int:
        """Of the first ``num_full`` blocks (the full group's hit), the longest prefix whose
        window part is cached here; its blocks are kept for ``allocate``."""
        blocks = [self.pool.get_cached_block(h) for h in hashes[:num_full]]
        best, last_missing = 0, -1
        for i, block in enumerate(blocks):
            if block is None:
                last_missing = i
            elif last_missing < self.first_needed((i + 1) * self.block_size):
                best = i + 1
        first = self.first_needed(best * self.block_size)
        hit = [self.null] * first + blocks[first:best]  # type: ignore[list-item]
        self._hits[request_id] = hit
        return best

    def drop_hit(self, request_id: str) -> None:
        self._hits.pop(request_id, None)

    def free_behind(self, request_id: str, num_computed: int) -> None:
        """Give back the blocks no later token attends to, oldest first."""
        table = self.tables.get(request_id)
        if not table:
            return
        behind = [b for b in table[:self.first_needed(num_computed)] if b is not self.null]
        if behind:
            self.pool.free_blocks(behind)
            for i in range(min(self.first_needed(num_computed), len(table))):
                table[i] = self.null

    def num_new(self, request_id: str, num_blocks: int, hit_len: int) -> int | None:
        """The blocks to add so the table reaches ``num_blocks`` (after a kept hit of
        ``hit_len`` blocks); None when the pool cannot give them."""
        table = self.tables.get(request_id, [])
        hit = self._hits.get(request_id, [])[:hit_len]
        need = num_blocks - len(table) - len(hit)
        idle = sum(1 for b in hit if b.ref_cnt == 0 and b is not self.null)
        return need if need <= self.pool.num_free_blocks - idle else None

    def allocate(self, request_id: str, num_new: int, hit_len: int) -> None:
        """Take the kept hit (``hit_len`` blocks of it) and ``num_new`` new blocks."""
        table = self.tables.setdefault(request_id, [])
        hit = self._hits.pop(request_id, [])[:hit_len]
        if hit:
            self.pool.touch(b for b in hit if b is not self.null)
        added = hit + (self.pool.get_new_blocks(num_new) if num_new > 0 else [])
        table.extend(added)
        self._added.setdefault(request_id, []).extend(b.block_id for b in added)

    def take_added(self) -> dict[str, list[int]]:
        added, self._added = self._added, {}
        return added

    def cache_blocks(self, request_id: str, hashes: Sequence[BlockHash], start: int,
                     end: int) -> None:
        """Register the newly full blocks ``start:end`` for prefix hits."""
        table = self.tables[request_id]
        for i in range(start, end):
            if table[i] is not self.null:
                self.pool.cache_block(table[i], hashes[i])

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(request_id, [])]

    def free(self, request_id: str) -> None:
        """Release a request's blocks, tail first (its last blocks evicted first)."""
        self._hits.pop(request_id, None)
        self._added.pop(request_id, None)
        table = self.tables.pop(request_id, [])
        self.pool.free_blocks(b for b in reversed(table) if b is not self.null)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
