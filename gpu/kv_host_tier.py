"""The host tensors of the KV cache's second tier (``--kv-offload-size``; the bookkeeping is
``core/host_tier.py``): per layer, tensors shaped as the device cache's (keys and values, and an
int8 cache's scales) with one row per host block, in pinned memory on a GPU. A step's copies
run before its forward: the blocks leaving the device first, then those coming back."""

from __future__ import annotations

import torch

from tidal.core.host_tier import KVCopies

LayerCache = tuple[torch.Tensor, ...]


class KVHostTier:
    def __init__(self, num_blocks: int, device_caches: list[LayerCache]) -> None:
        pin = bool(device_caches) and device_caches[0][0].is_cuda
        self.num_blocks = num_blocks
        self.caches = [tuple(torch.zeros((num_blocks, *t.shape[1:]), dtype=t.dtype,
                                         pin_memory=pin) for t in layer)
                       for layer in device_caches]

    @staticmethod
    def blocks_for(size_bytes: int, device_caches: list[LayerCache]) -> int:
        """How many blocks ``size_bytes`` of host memory hold, one block being a row of every
        tensor of every layer."""
        per_block = sum(t[0].numel() * t.element_size() for layer in device_caches
                        for t in layer)
        return size_bytes // per_block if per_block else 0

    def apply(self, copies: KVCopies, device_caches: list[LayerCache]) -> None:
        if not device_caches:
            return
        on = device_caches[0][0].device
        if copies.out:
            device, host = _indices(copies.out)
            device = device.to(on)
            for dev_layer, host_layer in zip(device_caches, self.caches):
                for dev, kept in zip(dev_layer, host_layer):
                    kept[host] = dev[device].to("cpu")
        if copies.into:
            host, device = _indices(copies.into)
            device = device.to(on)
            for dev_layer, host_layer in zip(device_caches, self.caches):
                for dev, kept in zip(dev_layer, host_layer):
                    dev[device] = kept[host].to(on, non_blocking=True)


def _indices(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs' first and second elements as index tensors."""
    return (torch.tensor([a for a, _ in pairs], dtype=torch.int64),
            torch.tensor([b for _, b in pairs], dtype=torch.int64))
