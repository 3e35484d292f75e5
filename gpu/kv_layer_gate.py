"""A step's KV caches as the forward sees them while the second tier's copies for that step
are still running (on the CPU): the forward takes layer ``i``'s cache once that layer's copies
are done, so the copies of the later layers run beside the forward of the earlier ones, and a
layer waits only for the blocks it reads and overwrites (``gpu/kv_copier.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import SupportsIndex

import torch

LayerCache = tuple[torch.Tensor, ...]


class LayerGate:
    """Per layer, a flag the copy thread sets once that layer's copies are done."""

    def __init__(self, num_layers: int) -> None:
        self._done = [threading.Event() for _ in range(num_layers)]
        self._error: BaseException | None = None

    def open(self, layer: int) -> None:
        self._done[layer].set()

    def open_all(self, error: BaseException | None = None) -> None:
        """Every layer is done (or the copies failed with ``error``)."""
        self._error = error
        for done in self._done:
            done.set()

    def wait(self, layer: int) -> None:
        self._done[layer].wait()
        if self._error is not None:
            raise RuntimeError("the KV tier's copies failed") from self._error

    @property
    def is_open(self) -> bool:
        return all(done.is_set() for done in self._done)


class GatedCaches(list):
    """The layers' caches, each handed out once its gate is open (by index or in order)."""

    def __init__(self, caches: list[LayerCache], gate: LayerGate) -> None:
        super().__init__(caches)
        self.gate = gate

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            for layer in range(*index.indices(len(self))):
                self.gate.wait(layer)
        else:
            self.gate.wait(_layer(index, len(self)))
        return super().__getitem__(index)

    def __iter__(self) -> Iterator[LayerCache]:
        for layer, cache in enumerate(super().__iter__()):
            self.gate.wait(layer)
            yield cache


def _layer(index: SupportsIndex, num_layers: int) -> int:
    i = index.__index__()
    return i + num_layers if i < 0 else i
