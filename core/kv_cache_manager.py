"""Per-request KV block bookkeeping on top of the block pool: prefix hits and allocation; for
a model with sliding-window layers, their own block group beside it (``core/kv_window.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from tidal.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from tidal.core.host_tier import HostTier, KVCopies, TierHit
from tidal.core.kv_window import WindowBlocks, WindowGroup
from tidal.core.request import Request, RequestStatus
from tidal.core.swap_policy import SwapPolicy


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 host_tier: HostTier | None = None, window: WindowGroup | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # per request: blocks already registered
        # per request: how many computed tokens its blocks take before ``allocate_slots`` has
        # anything to do (a block to add, or one newly full to register for prefix hits)
        self._room: dict[str, int] = {}
        self.stats = PrefixCacheStats()
        # the second tier (core/host_tier.py): evicted prefix blocks, copied back on a hit
        self.host = host_tier if enable_caching else None
        self._host_hits: dict[str, list[TierHit]] = {}  # request -> second-tier hits
        # a preempted request's way back, swap or recompute (core/swap_policy.py), counted
        # once its blocks are allocated
        self.swap_policy = SwapPolicy()
        self._resume_method: dict[str, str] = {}
        # the sliding-window layers' blocks, where the model has some (core/kv_window.py);
        # ``self.pool`` is then the full-attention layers'
        self.window = (WindowBlocks(window, window.pool_blocks(num_blocks), block_size,
                                    enable_caching) if window is not None else None)
        assert self.window is None or self.host is None, "the KV tier keeps one block group"
        if self.host is not None:
            self.pool.on_evict = self.host.store
            self.pool.recently_freed = set()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of full blocks, capped so at least one token is left to
        compute (the step must produce logits for the next token)."""
        if not self.enable_caching:
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        if self.window is not None:
            del hits[self.window.longest_hit(request.request_id, request.block_hashes,
                                             len(hits)):]
        host_hits = self._host_lookup(request, len(hits), max_blocks)
        num_hit = (len(hits) + len(host_hits)) * self.block_size
        self.stats.queries += request.num_tokens
        self.stats.hits += num_hit
        return hits, num_hit

    def _host_lookup(self, request: Request, start: int, max_blocks: int) -> list[TierHit]:
        """The second-tier hits of the blocks after the device's hits, as far as they go on;
        kept for ``allocate_slots``, which copies them into the blocks it allocates. A
        preempted request takes them only where copying is measured to be cheaper than
        computing them again."""
        if self.host is None:
            return []
        hits = []
        for block_hash in request.block_hashes[start:max_blocks]:
            hit = self.host.lookup(block_hash)
            if hit is None:
                break
            hits.append(hit)
        if hits and request.status == RequestStatus.PREEMPTED:
            num_disk = sum(1 for h in hits if h.tier == "disk")
            swap = self.swap_policy.swap(len(hits) - num_disk, num_disk, self.block_size)
            self._resume_method[request.request_id] = "swap" if swap else "recompute"
            hits = hits if swap else []
        self._host_hits[request.request_id] = hits
        return hits

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVCacheBlock] | None = None,
                       num_computed_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Reserve blocks for ``num_new_tokens`` more tokens (after any prefix hit).

        Returns the newly allocated blocks, or ``None`` (nothing changed) when too few are
        free.
        """
        if not computed_blocks and self.has_room(request, num_new_tokens):
            return []
        total = request.num_computed_tokens + num_computed_tokens + num_new_tokens
        computed_blocks = computed_blocks or []
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_new = self.blocks_needed(total) - len(blocks) - len(computed_blocks)
        idle_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0) if computed_blocks else 0
        num_new_window = self._window_room(request, total, len(computed_blocks),
                                           num_computed_tokens)
        if num_new > self.pool.num_free_blocks - idle_hits or num_new_window is None:
            if not blocks:
                del self.req_blocks[request.request_id]
            return None
        if self.window is not None:
            assert num_new_window is not None
            self.window.allocate(request.request_id, num_new_window, len(computed_blocks))
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
        host_hits = self._host_hits.pop(request.request_id, [])
        if host_hits:
            self.host.reserve(host_hits)  # type: ignore[union-attr]
        new_blocks = self.pool.get_new_blocks(num_new) if num_new > 0 else []
        blocks.extend(new_blocks)
        for hit, block in zip(host_hits, new_blocks):
            self.host.load_hit(hit, block.block_id)  # type: ignore[union-attr]
        method = self._resume_method.pop(request.request_id, None)
        if method is not None:
            self.swap_policy.resumptions[method] += 1
        room = len(blocks) * self.block_size
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, min(total, request.num_tokens))
            # the next block to fill must be registered once full
            room = min(room, (self.num_cached_blocks[request.request_id] + 1) * self.block_size - 1)
        self._room[request.request_id] = room
        return new_blocks

    def _window_room(self, request: Request, total: int, num_hit_blocks: int,
                     num_hit_tokens: int) -> int | None:
        """The window group's new blocks for ``total`` tokens (after giving back those left
        behind); None when its pool cannot give them (0 without a window group)."""
        if self.window is None:
            return 0
        self.window.free_behind(request.request_id,
                                request.num_computed_tokens + num_hit_tokens)
        return self.window.num_new(request.request_id, self.blocks_needed(total),
                                   num_hit_blocks)

    def take_new_window_block_ids(self) -> dict[str, list[int]]:
        """The window group's blocks added to each table since the last call (a new
        request's whole table); none without a window group. Called once a step."""
        return self.window.take_added() if self.window is not None else {}

    def take_copies(self) -> KVCopies | None:
        """The second tier's copies for the step just scheduled (None: none). They run beside
        the forward of the step in flight unless they touch a block freed since that step was
        scheduled (a finished or preempted request's, which it may still read or write).
        Called once a step, at the end of its scheduling."""
        if self.host is None:
            return None
        copies = self.host.take_copies()
        freed = self.pool.take_recently_freed()
        if copies is not None:
            copies.after_step = not freed.isdisjoint(copies.device_blocks())
        return copies

    def has_room(self, request: Request, num_new_tokens: int) -> bool:
        """Whether ``request``'s blocks hold ``num_new_tokens`` more computed tokens with none
        of them becoming full: then ``allocate_slots`` has nothing to do (most decode steps)."""
        return (request.num_computed_tokens + num_new_tokens
                <= self._room.get(request.request_id, -1))

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first so its last blocks are evicted first."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self._host_hits.pop(request.request_id, None)
        self._resume_method.pop(request.request_id, None)
        self._room.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))
        if self.window is not None:
            self.window.free(request.request_id)

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache (``BlockPool.reset_prefix_cache``); the hit counters stay, as
        counters do."""
        if self.host is not None:
            self.host.clear()
        window_empty = self.window.reset_prefix_cache() if self.window is not None else True
        return self.pool.reset_prefix_cache() and window_empty

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def _update_block_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        bs = self.block_size
        for i in range(len(hashes), request.num_tokens // bs):
            parent = hashes[i - 1] if i else None
            hashes.append(hash_block_tokens(parent, request.all_token_ids[i * bs:(i + 1) * bs]))

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock],
                           num_tokens: int) -> None:
        self._update_block_hashes(request)
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = num_tokens // self.block_size
        for i in range(start, end):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        if self.window is not None:
            self.window.cache_blocks(request.request_id, request.block_hashes, start, end)
        self.num_cached_blocks[request.request_id] = max(start, end)
