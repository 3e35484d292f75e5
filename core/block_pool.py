"""The pool of KV cache blocks: reference counts, an LRU free list and the prefix-cache index.

A block whose last user finished keeps its contents and its hash: it sits in the free list and
can still be hit by a later request with the same prefix, until it is evicted (the head of the
free list is evicted first, so the least recently freed block goes first).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

BlockHash = bytes


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained SHA-256 over a full block: equal hashes mean equal whole prefixes."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) pop from the head, append and remove anywhere."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free += 1

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free -= 1


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.enable_caching = enable_caching
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        # told of each cached block about to be reused (the host tier keeps it)
        self.on_evict: Callable[[BlockHash, int], None] | None = None
        # blocks freed since ``take_recently_freed`` (kept where a second tier asks for them:
        # the step in flight may still use them, so a copy touching one waits for it)
        self.recently_freed: set[int] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        blocks = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if self.on_evict is not None and block.block_hash is not None \
                    and self.cached.get(block.block_hash) is block:
                self.on_evict(block.block_hash, block.block_id)
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling idle ones out of the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; blocks reaching zero join the free list in the given order."""
        for block in ordered:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                self.free_queue.append(block)
                if self.recently_freed is not None:
                    self.recently_freed.add(block.block_id)

    def take_recently_freed(self) -> set[int]:
        """The blocks freed since the last call (``recently_freed``), forgetting them."""
        freed, self.recently_freed = self.recently_freed or set(), set()
        return freed

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:  # same prefix computed twice: keep the first copy
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix of every idle block, so no later request hits it. Blocks held by
        running requests keep theirs: their owners still use them. True when the index is
        empty afterwards, False when running requests kept some entries."""
        for block in self.blocks:
            if block.ref_cnt == 0:
                self._evict(block)
        return not self.cached
