"""The host tensors of the KV cache's second tier (``--kv-offload-size``; the bookkeeping is
``core/host_tier.py``): per layer, tensors shaped as the device cache's (keys and values, and an
int8 cache's scales) with one row per host block, in pinned memory on a GPU; and behind them
the disk file, if any (``gpu/kv_disk_tier.py``). A step's copies run on the copy thread
(``gpu/kv_copier.py``), in the order ``apply`` gives."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from tidal.core.host_tier import KVCopies
from tidal.gpu.kv_disk_tier import KVDiskTier
from tidal.gpu.kv_layer_gate import LayerGate

LayerCache = tuple[torch.Tensor, ...]


class KVHostTier:
    def __init__(self, num_blocks: int, device_caches: list[LayerCache]) -> None:
        pin = bool(device_caches) and device_caches[0][0].is_cuda
        self.num_blocks = num_blocks
        self.caches = [tuple(torch.zeros((num_blocks, *t.shape[1:]), dtype=t.dtype,
                                         pin_memory=pin) for t in layer)
                       for layer in device_caches]
        self.disk: KVDiskTier | None = None  # --kv-offload-path's file, set by the runner

    @staticmethod
    def blocks_for(size_bytes: int, device_caches: list[LayerCache]) -> int:
        """How many blocks ``size_bytes`` of host memory hold, one block being a row of every
        tensor of every layer."""
        per_block = sum(t[0].numel() * t.element_size() for layer in device_caches
                        for t in layer)
        return size_bytes // per_block if per_block else 0

    def apply(self, copies: KVCopies, device_caches: list[LayerCache],
              sync: Callable[[], None] = lambda: None,
              issued: Callable[[], None] = lambda: None,
              gate: LayerGate | None = None) -> dict[str, tuple[int, float]]:
        """Run a step's copies in order; returns the copies in, per tier, as (blocks,
        seconds), ``sync`` (the copy stream's) ending each timing. ``issued`` is called once
        every copy touching the device is issued, ``gate`` opened layer by layer as each
        layer's are done (at the end when a block comes from disk straight to the device).

        First the whole rows: host slots to disk, evicted device blocks straight to disk,
        disk hits into host slots (promoted); then layer by layer the device blocks leaving
        for the host and those coming back from it (a block leaves before the one coming
        back into its device slot lands); last the disk hits with no host slot."""
        disk = self.disk
        timing: dict[str, tuple[int, float]] = {}
        try:
            if disk is not None:
                self._rows(disk, copies, device_caches, timing)
            into_seconds = self._layers(copies, device_caches, None if copies.from_disk
                                        else gate)
            if disk is not None and copies.from_disk:
                start = time.perf_counter()
                disk_slots, device_blocks = _columns(copies.from_disk)
                disk.read(disk_slots, device_caches, device_blocks)
                sync()
                had = timing.get("disk", (0, 0.0))
                timing["disk"] = (had[0] + len(copies.from_disk),
                                  had[1] + time.perf_counter() - start)
        except BaseException as e:
            if gate is not None:
                gate.open_all(e)
            raise
        if gate is not None:
            gate.open_all()
        issued()
        if copies.into:
            start = time.perf_counter()
            sync()
            timing["host"] = (len(copies.into), into_seconds + time.perf_counter() - start)
        return timing

    def _rows(self, disk: KVDiskTier, copies: KVCopies, device_caches: list[LayerCache],
              timing: dict[str, tuple[int, float]]) -> None:
        """The copies of whole rows, before the layers'."""
        if copies.clear_disk:
            disk.clear()
        for spilled, caches in ((copies.to_disk, self.caches),
                                (copies.out_to_disk, device_caches)):
            if spilled:
                blocks, disk_slots, block_hashes = _columns(spilled)
                disk.write(disk_slots, block_hashes, caches, blocks)
        if copies.promote:  # kept in host memory, then copied in from there
            start = time.perf_counter()
            disk_slots, host_slots = _columns(copies.promote)
            disk.read(disk_slots, self.caches, host_slots)
            timing["disk"] = (len(copies.promote), time.perf_counter() - start)

    def _layers(self, copies: KVCopies, device_caches: list[LayerCache],
                gate: LayerGate | None) -> float:
        """The copies out of and into the device, layer by layer, opening ``gate``'s layers
        as they are done; returns the seconds spent issuing the copies in."""
        if not device_caches:
            return 0.0
        on = device_caches[0][0].device
        out_from, out_to = _indices(copies.out)
        into_from, into_to = _indices(copies.into)
        out_from, into_to = out_from.to(on), into_to.to(on)
        into_seconds = 0.0
        # per tensor one gather and one scatter of all the step's blocks (index_select and
        # index_copy_: a plain copy per row, where indexing goes through the general kernel)
        for layer, (dev_layer, host_layer) in enumerate(zip(device_caches, self.caches)):
            for dev, kept in zip(dev_layer, host_layer):
                if copies.out:
                    kept.index_copy_(0, out_to, dev.index_select(0, out_from).to("cpu"))
                if copies.into:
                    start = time.perf_counter()
                    dev.index_copy_(0, into_to, kept.index_select(0, into_from).to(
                        on, non_blocking=True))
                    into_seconds += time.perf_counter() - start
            if gate is not None:
                gate.open(layer)
        return into_seconds


def _columns(rows: list[tuple]) -> list[list]:
    """A step's copies (tuples) as their columns: the sources, the targets, ..."""
    return [list(column) for column in zip(*rows)]


def _indices(pairs: list[tuple[int, int]]) -> list[torch.Tensor]:
    """The pairs' first and second elements as index tensors."""
    return [torch.tensor([a for a, _ in pairs], dtype=torch.int64),
            torch.tensor([b for _, b in pairs], dtype=torch.int64)]
