"""The KV tier's copies beside the step: each step's copies (``core/host_tier.py``'s
``KVCopies``) run on a thread of their own, and on a GPU on a CUDA stream of their own, while
the step thread prepares the step's inputs; the forward waits for them (``wait``), so a block
copied in has landed before the forward reads it and a block copied out was read before the
forward overwrites its device slot.

On a GPU the copy stream first waits for everything the step stream has queued (the previous
step's forward wrote the blocks this step copies out), and the copy thread synchronizes its
stream before it finishes: the forward, queued after ``wait``, cannot start before the copies
end, and the host memory the disk writes read is filled. One thread runs the steps' copies in
their order, so a step's copies never overtake the previous step's.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tidal.core.host_tier import KVCopies
from tidal.gpu.kv_host_tier import KVHostTier, LayerCache


class KVCopier:
    def __init__(self, tier: KVHostTier, device: torch.device) -> None:
        self.tier = tier
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tidal-kv-copies")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pending: Future[dict[str, tuple[int, float]]] | None = None
        self._timing: dict[str, tuple[int, float]] = {}  # copies in since the last take

    def submit(self, copies: KVCopies, device_caches: list[LayerCache]) -> None:
        """Start a step's copies on the copy thread (after any earlier step's)."""
        ready = torch.cuda.current_stream().record_event() if self._stream else None
        self.wait()
        self._pending = self._thread.submit(self._run, copies, device_caches, ready)

    def wait(self) -> None:
        """Block until the submitted copies are done (and raise their error, if any)."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        for tier, (blocks, seconds) in pending.result().items():
            had = self._timing.get(tier, (0, 0.0))
            self._timing[tier] = (had[0] + blocks, had[1] + seconds)

    def take_timing(self) -> dict[str, tuple[int, float]]:
        """The copies in since the last call, per tier: (blocks, seconds)."""
        timing, self._timing = self._timing, {}
        return timing

    def shutdown(self) -> None:
        self.wait()
        if self.tier.disk is not None:
            self.tier.disk.flush()
        self._thread.shutdown()

    def _run(self, copies: KVCopies, device_caches: list[LayerCache],
             ready: torch.cuda.Event | None) -> dict[str, tuple[int, float]]:
        stream = self._stream
        on_stream = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with torch.inference_mode(), on_stream:
            if stream is not None:
                stream.wait_event(ready)
            timing = self.tier.apply(copies, device_caches,
                                     stream.synchronize if stream is not None else _nothing)
            if stream is not None:
                stream.synchronize()
        return timing


def _nothing() -> None:
    pass
