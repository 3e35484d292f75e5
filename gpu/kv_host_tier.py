"""The host tensors of the KV cache's second tier (``--kv-offload-size``; the bookkeeping is
``core/host_tier.py``): per layer, tensors shaped as the device cache's (keys and values, and an
int8 cache's scales) with one row per host block, in pinned memory on a GPU; and behind them
the disk file, if any (``gpu/kv_disk_tier.py``). A step's copies run before its forward (on the
copy thread, ``gpu/kv_copier.py``): host slots to disk, the blocks leaving the device (for
host memory, or for disk when no host slot was free), then those coming back from disk and
from host memory."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from tidal.core.host_tier import KVCopies
from tidal.gpu.kv_disk_tier import KVDiskTier

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
              sync: Callable[[], None] = lambda: None) -> dict[str, tuple[int, float]]:
        """Run a step's copies in order; returns the copies in, per tier, as (blocks,
        seconds), ``sync`` (the copy stream's) ending each timing."""
        if not device_caches:
            return {}
        disk = self.disk
        if disk is not None and copies.clear_disk:
            disk.clear()
        if disk is not None:
            for host_slot, disk_slot, block_hash in copies.to_disk:
                disk.write(disk_slot, block_hash, self.caches, host_slot)
        on = device_caches[0][0].device
        if copies.out:
            device, host = _indices(copies.out)
            device = device.to(on)
            for dev_layer, host_layer in zip(device_caches, self.caches):
                for dev, kept in zip(dev_layer, host_layer):
                    kept[host] = dev[device].to("cpu")
        if disk is not None:
            for device_block, disk_slot, block_hash in copies.out_to_disk:
                disk.write(disk_slot, block_hash, device_caches, device_block)
        timing = {}
        if disk is not None and copies.from_disk:
            start = time.perf_counter()
            for disk_slot, device_block in copies.from_disk:
                disk.read(disk_slot, device_caches, device_block)
            sync()
            timing["disk"] = (len(copies.from_disk), time.perf_counter() - start)
        if copies.into:
            start = time.perf_counter()
            host, device = _indices(copies.into)
            device = device.to(on)
            for dev_layer, host_layer in zip(device_caches, self.caches):
                for dev, kept in zip(dev_layer, host_layer):
                    dev[device] = kept[host].to(on, non_blocking=True)
            sync()
            timing["host"] = (len(copies.into), time.perf_counter() - start)
        return timing


def _indices(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs' first and second elements as index tensors."""
    return (torch.tensor([a for a, _ in pairs], dtype=torch.int64),
            torch.tensor([b for _, b in pairs], dtype=torch.int64))
