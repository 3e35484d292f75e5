"""The second tier of KV blocks: host memory (``--kv-offload-size``) that keeps the prefix-cache
blocks the device pool evicts, so that a prefix that fell out of the device cache, or the blocks
of a request preempted and pushed out, come back by a copy instead of a prefill.

This is the bookkeeping, plain Python: which block hash sits in which host slot (least
recently used first out), and the copies each step asks of the runner, which holds the host
tensors (``gpu/kv_host_tier.py``). A step's copies run before its forward, the copies out
before the copies in: a device block evicted and then reused for a host hit is saved before
it is overwritten. A host slot that a copy of this step reads is not handed out again in the
same step, so the copies in always read what was stored.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from tidal.core.block_pool import BlockHash


@dataclass
class KVCopies:
    """One step's copies: ``out`` (device block, host slot) pairs, then ``into`` (host slot,
    device block) pairs."""

    out: list[tuple[int, int]] = field(default_factory=list)
    into: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.out or self.into)


@dataclass
class HostTierStats:
    stored: int = 0  # blocks copied out of the device pool
    hits: int = 0  # blocks copied back for a prefix
    dropped: int = 0  # evictions not kept (every slot read this step)


class HostTier:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._free = list(range(num_blocks - 1, -1, -1))
        self._copies = KVCopies()
        self._read: set[int] = set()  # slots this step's copies in read
        self.stats = HostTierStats()

    @property
    def num_used(self) -> int:
        return len(self._slots)

    def store(self, block_hash: BlockHash, device_block: int) -> None:
        """Keep an evicted device block (its hash and contents) in a host slot."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return
        slot = self._take_slot()
        if slot is None:
            self.stats.dropped += 1
            return
        self._slots[block_hash] = slot
        self._copies.out.append((device_block, slot))
        self.stats.stored += 1

    def find(self, block_hash: BlockHash) -> int | None:
        """The host slot holding ``block_hash``, if any (now the most recently used)."""
        slot = self._slots.get(block_hash)
        if slot is not None:
            self._slots.move_to_end(block_hash)
        return slot

    def load(self, slot: int, device_block: int) -> None:
        """Copy a slot back into a device block before this step's forward."""
        self._copies.into.append((slot, device_block))
        self._read.add(slot)
        self.stats.hits += 1

    def take_copies(self) -> KVCopies | None:
        """This step's copies (None if none), leaving the next step's list empty."""
        copies, self._copies, self._read = self._copies, KVCopies(), set()
        return copies or None

    def clear(self) -> None:
        """Forget every stored block (the prefix cache is being reset)."""
        self._slots.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for block_hash, slot in self._slots.items():  # the least recently used not read now
            if slot not in self._read:
                del self._slots[block_hash]
                return slot
        return None
