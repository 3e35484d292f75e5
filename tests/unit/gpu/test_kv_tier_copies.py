"""The second tier's copies, batched (``gpu/kv_host_tier.py``, ``gpu/kv_disk_tier.py``): one
step's copies of every kind, each block landing where a plain row-by-row torch copy puts it."""

from __future__ import annotations

from pathlib import Path

import torch

from tidal.core.host_tier import KVCopies
from tidal.gpu.kv_disk_tier import KVDiskTier
from tidal.gpu.kv_host_tier import KVHostTier


def _caches(num_blocks: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """Two layers of keys and values, and an int8 cache's scales beside them in the second."""
    g = torch.Generator().manual_seed(seed)
    first = tuple(torch.randn(num_blocks, 4, 2, 8, generator=g) for _ in range(2))
    second = (*(torch.randint(-128, 127, (num_blocks, 4, 2, 8), generator=g,
                              dtype=torch.int8) for _ in range(2)),
              *(torch.rand(num_blocks, 4, 2, generator=g) for _ in range(2)))
    return [first, second]


def _clone(caches: list[tuple[torch.Tensor, ...]]) -> list[tuple[torch.Tensor, ...]]:
    return [tuple(t.clone() for t in layer) for layer in caches]


def _copy_row(dst: list[tuple[torch.Tensor, ...]], i: int,
              src: list[tuple[torch.Tensor, ...]], j: int) -> None:
    for dst_layer, src_layer in zip(dst, src):
        for d, s in zip(dst_layer, src_layer):
            d[i] = s[j]


def _assert_equal(got: list[tuple[torch.Tensor, ...]],
                  want: list[tuple[torch.Tensor, ...]]) -> None:
    for got_layer, want_layer in zip(got, want):
        for g, w in zip(got_layer, want_layer):
            assert torch.equal(g, w)


def test_a_steps_copies_land_where_row_by_row_copies_put_them(tmp_path: Path) -> None:
    device = _caches(12, seed=1)
    tier = KVHostTier(6, device)
    tier.caches = _caches(6, seed=2)
    tier.disk = KVDiskTier(str(tmp_path), 8, device, {"test": 1})
    on_disk = _caches(8, seed=3)  # what the disk's slots hold, written from a device copy
    tier.disk.write(list(range(8)), [bytes([s + 1]) * 32 for s in range(8)], on_disk,
                    list(range(8)))
    assert tier.disk.index() == {s: bytes([s + 1]) * 32 for s in range(8)}

    want_device, want_host, want_disk = _clone(device), _clone(tier.caches), _clone(on_disk)
    copies = KVCopies(to_disk=[(1, 6, b"a" * 32), (4, 2, b"b" * 32)],
                      out_to_disk=[(9, 7, b"c" * 32)], promote=[(5, 1), (0, 4)],
                      out=[(3, 0), (10, 3)], into=[(2, 3), (4, 10)], from_disk=[(2, 11)])
    # the reference, in KVCopies' order, a row at a time
    for host_slot, disk_slot, _ in copies.to_disk:
        _copy_row(want_disk, disk_slot, want_host, host_slot)
    for block, disk_slot, _ in copies.out_to_disk:
        _copy_row(want_disk, disk_slot, want_device, block)
    for disk_slot, host_slot in copies.promote:
        _copy_row(want_host, host_slot, want_disk, disk_slot)
    for block, host_slot in copies.out:
        _copy_row(want_host, host_slot, want_device, block)
    for host_slot, block in copies.into:
        _copy_row(want_device, block, want_host, host_slot)
    for disk_slot, block in copies.from_disk:
        _copy_row(want_device, block, want_disk, disk_slot)

    timing = tier.apply(copies, device)
    _assert_equal(device, want_device)
    _assert_equal(tier.caches, want_host)
    read_back = _caches(8, seed=4)
    tier.disk.read(list(range(8)), read_back, list(range(8)))
    _assert_equal(read_back, want_disk)
    assert tier.disk.index()[6] == b"a" * 32 and tier.disk.index()[7] == b"c" * 32
    assert timing["host"][0] == 2 and timing["disk"][0] == 3  # two promoted, one straight in
