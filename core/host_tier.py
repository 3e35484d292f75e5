"""The second tier of KV blocks: host memory (``--kv-offload-size``) that keeps the prefix-cache
blocks the device pool evicts, so that a prefix that fell out of the device cache, or the blocks
of a request preempted and pushed out, come back by a copy instead of a prefill; and behind it,
optionally, a file on disk (``--kv-offload-path``) that takes the blocks the host slots evict
and outlives the process.

This is the bookkeeping, plain Python: which block hash sits in which host or disk slot (least
recently used first out), and the copies each step asks of the runner, which holds the host
tensors and the file (``gpu/kv_host_tier.py``, ``gpu/kv_disk_tier.py``). A step's copies run
beside the forward, in ``KVCopies``' order. So that order is always right, a slot (host or
disk) read or written by a copy of this step is not handed out again in the same step; a block
evicted while every host slot is busy goes straight to disk.

A block found on disk is promoted: read into a host slot (and from there into its device
block), so it stays in host memory and the next hit on it is a host hit; it is kept on disk
too. Only when every host slot is busy does it go from disk straight into the device block.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from tidal.core.block_pool import BlockHash


@dataclass
class KVCopies:
    """One step's copies, run in this order: ``clear_disk`` (forget every block on disk),
    ``to_disk`` (host slot, disk slot, block hash), ``out_to_disk`` (device block, disk slot,
    block hash: no host slot was free), ``promote`` (disk slot, host slot: a disk hit kept in
    host memory), then layer by layer ``out`` (device block, host slot) and ``into`` (host
    slot, device block), last ``from_disk`` (disk slot, device block: no host slot was free).
    A device block leaves (``out``) before another block lands in it."""

    out: list[tuple[int, int]] = field(default_factory=list)
    into: list[tuple[int, int]] = field(default_factory=list)
    to_disk: list[tuple[int, int, BlockHash]] = field(default_factory=list)
    out_to_disk: list[tuple[int, int, BlockHash]] = field(default_factory=list)
    promote: list[tuple[int, int]] = field(default_factory=list)
    from_disk: list[tuple[int, int]] = field(default_factory=list)
    clear_disk: bool = False
    # whether the copies touch a device block the step in flight may still read or write (one
    # freed since it was scheduled): then they wait for that step's forward; else they run
    # beside it (KVCacheManager.take_copies)
    after_step: bool = True

    def device_blocks(self) -> set[int]:
        """The device blocks these copies read or write."""
        return ({b for b, _ in self.out} | {b for b, _, _ in self.out_to_disk}
                | {b for _, b in self.from_disk} | {b for _, b in self.into})

    def __bool__(self) -> bool:
        return bool(self.out or self.into or self.to_disk or self.out_to_disk or self.promote
                    or self.from_disk or self.clear_disk)


@dataclass
class HostTierStats:
    stored: int = 0  # blocks copied out of the device pool
    hits: int = 0  # blocks copied back for a prefix, from host memory
    dropped: int = 0  # evictions not kept (every slot busy this step)
    disk_stored: int = 0  # blocks written to disk (host evictions, and direct ones)
    disk_direct: int = 0  # of which straight from the device (every host slot was busy)
    disk_hits: int = 0  # blocks copied back for a prefix, from disk
    promoted: int = 0  # of which kept in host memory too (the next hit is a host hit)
    disk_loaded: int = 0  # blocks found on disk at start (a restart's)


@dataclass(frozen=True)
class TierHit:
    """Where a prefix block was found: ``tier`` is "host" or "disk"."""

    tier: str
    slot: int
    block_hash: BlockHash = field(default=b"", compare=False)


class SlotTable:
    """Block hashes in numbered slots, least recently used first out; ``busy`` slots (read or
    written by this step's copies) are not taken back before the step's copies are sent."""

    def __init__(self, num_slots: int, index: dict[int, BlockHash] | None = None) -> None:
        self.num_slots = num_slots
        self.slots: OrderedDict[BlockHash, int] = OrderedDict(
            (h, s) for s, h in sorted((index or {}).items()) if s < num_slots)
        taken = set(self.slots.values())
        self.free = [s for s in range(num_slots - 1, -1, -1) if s not in taken]
        self.busy: set[int] = set()

    def find(self, block_hash: BlockHash) -> int | None:
        slot = self.slots.get(block_hash)
        if slot is not None:
            self.slots.move_to_end(block_hash)
        return slot

    def take(self) -> tuple[int, BlockHash | None] | None:
        """A slot for a new block, and the hash it evicts (None: it was free); None when every
        slot is busy."""
        if self.free:
            return self.free.pop(), None
        for block_hash, slot in self.slots.items():
            if slot not in self.busy:
                del self.slots[block_hash]
                return slot, block_hash
        return None

    def clear(self) -> None:
        self.slots.clear()
        self.free = list(range(self.num_slots - 1, -1, -1))

    def leaked(self) -> set[int]:
        """Slots neither free nor holding a block (or both): none, unless a bug lost one."""
        held, free = Counter(self.slots.values()), Counter(self.free)
        every = set(range(self.num_slots))
        shared = {s for s, n in (held + free).items() if n > 1}
        return (every - set(held) - set(free)) | shared | (set(held) | set(free)) - every


class HostTier:
    def __init__(self, num_blocks: int, disk_blocks: int = 0,
                 disk_index: dict[int, BlockHash] | None = None) -> None:
        self.num_blocks = num_blocks
        self._host = SlotTable(num_blocks)
        self.disk = SlotTable(disk_blocks, disk_index) if disk_blocks else None
        self._copies = KVCopies()
        self.stats = HostTierStats(disk_loaded=self.num_used_disk)

    @property
    def num_used(self) -> int:
        return len(self._host.slots)

    @property
    def num_disk_blocks(self) -> int:
        return self.disk.num_slots if self.disk is not None else 0

    @property
    def num_used_disk(self) -> int:
        return len(self.disk.slots) if self.disk is not None else 0

    def leaked_slots(self) -> dict[str, set[int]]:
        """Per tier, the slots lost to bookkeeping (``SlotTable.leaked``): empty sets."""
        tables = {"host": self._host, "disk": self.disk}
        return {name: t.leaked() for name, t in tables.items() if t is not None}

    def store(self, block_hash: BlockHash, device_block: int) -> None:
        """Keep an evicted device block (its hash and contents) in a host slot."""
        if block_hash in self._host.slots:
            self._host.slots.move_to_end(block_hash)
            return
        slot = self._host_slot_for(block_hash)
        if slot is None:
            disk_slot = self._disk_slot(block_hash)
            if disk_slot is None:
                self.stats.dropped += 1
            elif disk_slot >= 0:
                self._copies.out_to_disk.append((device_block, disk_slot, block_hash))
                self.stats.disk_direct += 1
            return
        self._copies.out.append((device_block, slot))
        self.stats.stored += 1

    def find(self, block_hash: BlockHash) -> int | None:
        """The host slot holding ``block_hash``, if any (now the most recently used)."""
        return self._host.find(block_hash)

    def lookup(self, block_hash: BlockHash) -> TierHit | None:
        """Where ``block_hash`` is kept, host memory first, then disk."""
        slot = self._host.find(block_hash)
        if slot is not None:
            return TierHit("host", slot, block_hash)
        slot = self.disk.find(block_hash) if self.disk is not None else None
        return TierHit("disk", slot, block_hash) if slot is not None else None

    def reserve(self, hits: list[TierHit]) -> None:
        """Keep the slots of hits about to be loaded from being taken by the evictions that
        allocating their device blocks causes."""
        for hit in hits:
            table = self._host if hit.tier == "host" else self.disk
            assert table is not None
            table.busy.add(hit.slot)

    def load(self, slot: int, device_block: int) -> None:
        """Copy a host slot back into a device block before this step's forward."""
        self._copies.into.append((slot, device_block))
        self._host.busy.add(slot)
        self.stats.hits += 1

    def load_hit(self, hit: TierHit, device_block: int) -> None:
        """Copy a block found by ``lookup`` back into a device block."""
        if hit.tier == "host":
            self.load(hit.slot, device_block)
            return
        assert self.disk is not None
        self.disk.busy.add(hit.slot)
        self.stats.disk_hits += 1
        host_slot = self._host_slot_for(hit.block_hash) if hit.block_hash else None
        if host_slot is None:  # every host slot is busy this step: straight in
            self._copies.from_disk.append((hit.slot, device_block))
            return
        self._copies.promote.append((hit.slot, host_slot))
        self._copies.into.append((host_slot, device_block))
        self.stats.promoted += 1

    def persist(self, device_blocks: list[tuple[BlockHash, int]]) -> KVCopies | None:
        """The copies that put on disk every block kept in host memory, then every cached
        device block (``device_blocks``: hash, block) that no tier holds: a server shutting
        down leaves its prefixes for the next one. Their slots are taken least recently used
        first, as ever; once every disk slot is taken the rest are left out."""
        if self.disk is None:
            return None
        for block_hash, slot in list(self._host.slots.items()):
            self._spill(block_hash, slot)
        for block_hash, block in device_blocks:
            if block_hash not in self._host.slots:
                disk_slot = self._disk_slot(block_hash)
                if disk_slot is not None and disk_slot >= 0:
                    self._copies.out_to_disk.append((block, disk_slot, block_hash))
        return self.take_copies()

    def take_copies(self) -> KVCopies | None:
        """This step's copies (None if none), leaving the next step's list empty."""
        copies, self._copies = self._copies, KVCopies()
        self._host.busy = set()
        if self.disk is not None:
            self.disk.busy = set()
        return copies or None

    def clear(self) -> None:
        """Forget every stored block (the prefix cache is being reset), on disk too."""
        self._host.clear()
        if self.disk is not None:
            self.disk.clear()
            self._copies.to_disk.clear()
            self._copies.clear_disk = True

    def _host_slot_for(self, block_hash: BlockHash) -> int | None:
        """A host slot, now ``block_hash``'s and busy this step (its evicted block spilled to
        disk first); None when every host slot is busy."""
        taken = self._host.take()
        if taken is None:
            return None
        slot, evicted = taken
        if evicted is not None:
            self._spill(evicted, slot)
        self._host.slots[block_hash] = slot
        self._host.busy.add(slot)
        return slot

    def _spill(self, block_hash: BlockHash, host_slot: int) -> None:
        """Move the block a host slot is losing to disk (before the slot is overwritten)."""
        disk_slot = self._disk_slot(block_hash)
        if disk_slot is not None and disk_slot >= 0:
            self._copies.to_disk.append((host_slot, disk_slot, block_hash))

    def _disk_slot(self, block_hash: BlockHash) -> int | None:
        """A disk slot to write ``block_hash`` into, now its; -1 when the disk holds it
        already, None when there is no disk or every slot is busy."""
        disk = self.disk
        if disk is None:
            return None
        if block_hash in disk.slots:  # already there (it came back from disk earlier)
            disk.slots.move_to_end(block_hash)
            return -1
        taken = disk.take()
        if taken is None:
            return None
        disk.slots[block_hash] = taken[0]
        disk.busy.add(taken[0])
        self.stats.disk_stored += 1
        return taken[0]
