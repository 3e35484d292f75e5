"""The KV tier's copies beside the forward: each step's copies (``core/host_tier.py``'s
``KVCopies``) run on a thread of their own, and on a GPU on a CUDA stream of their own.

On a GPU they start at once, beside the forward of the step still in flight, unless they touch
a block that step may still read or write (``KVCopies.after_step``: a block freed since it was
scheduled); then the copy stream first waits for what the step stream has queued. The step
they belong to waits for them on the device, not on the host: once the copy thread has issued
them it records an event on the copy stream, and the step stream waits for that event before
the forward (``wait_issued``), so a block copied in has landed before the forward reads it and
a block copied out was read before the forward overwrites its device slot.

On the CPU the copies run beside the step's input preparation and its forward: they are done
layer by layer, and the forward takes each layer's cache once that layer's copies are done
(``forward_caches``, ``gpu/kv_layer_gate.py``), so the later layers' copies run beside the
earlier layers' compute.

The copy thread then synchronizes its stream (timing the copies in, for the swap policy)
before it takes the next step's copies: one thread runs the steps' copies in their order, so a
step's copies never overtake the previous step's, and the host memory a disk write reads is
filled.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tidal.core.host_tier import KVCopies
from tidal.gpu.kv_host_tier import KVHostTier, LayerCache
from tidal.gpu.kv_layer_gate import GatedCaches, LayerGate

Timing = dict[str, tuple[int, float]]


class KVCopier:
    def __init__(self, tier: KVHostTier, device: torch.device) -> None:
        self.tier = tier
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tidal-kv-copies")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pending: Future[Timing] | None = None
        self._issued: Future[torch.cuda.Event | None] | None = None
        self._timing: Timing = {}  # copies in since the last take
        self.gate: LayerGate | None = None  # the latest step's layers copied (CPU)

    def submit(self, copies: KVCopies, device_caches: list[LayerCache]) -> None:
        """Start a step's copies on the copy thread (after any earlier step's)."""
        after = self._stream is not None and copies.after_step
        ready = torch.cuda.current_stream().record_event() if after else None
        self.wait()
        self._issued = issued = Future()
        self.gate = LayerGate(len(device_caches)) if self._stream is None else None
        self._pending = self._thread.submit(self._run, copies, device_caches, ready, issued,
                                            self.gate)

    def forward_caches(self, caches: list[LayerCache]) -> list[LayerCache]:
        """The caches a forward reads: on the CPU, while copies are running, each layer's
        handed out once its copies are done."""
        gate = self.gate
        return GatedCaches(caches, gate) if gate is not None and not gate.is_open else caches

    def wait_issued(self) -> None:
        """Make the step wait for its copies: on a GPU, its stream (on the device) for the copy
        stream's event; on the CPU, until they are done."""
        if self._issued is None:
            return
        issued, self._issued = self._issued, None
        event = issued.result()  # raises the copies' error, if any
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def wait(self) -> None:
        """Block until the submitted copies are done (and raise their error, if any)."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        self.wait_issued()
        for tier, (blocks, seconds) in pending.result().items():
            had = self._timing.get(tier, (0, 0.0))
            self._timing[tier] = (had[0] + blocks, had[1] + seconds)

    def take_timing(self) -> Timing:
        """The copies in since the last call, per tier: (blocks, seconds); a step's copies
        count once the copy thread is done with them."""
        if self._pending is not None and self._pending.done():
            self.wait()
        timing, self._timing = self._timing, {}
        return timing

    def shutdown(self) -> None:
        self.wait()
        if self.tier.disk is not None:
            self.tier.disk.flush()
        self._thread.shutdown()

    def _run(self, copies: KVCopies, device_caches: list[LayerCache],
             ready: torch.cuda.Event | None, issued: Future[torch.cuda.Event | None],
             gate: LayerGate | None) -> Timing:
        stream = self._stream
        on_stream = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

        def mark_issued() -> None:
            if not issued.done():
                issued.set_result(stream.record_event() if stream is not None else None)

        try:
            with torch.inference_mode(), on_stream:
                if ready is not None:
                    stream.wait_event(ready)  # type: ignore[union-attr]
                timing = self.tier.apply(copies, device_caches,
                                         stream.synchronize if stream is not None else _nothing,
                                         mark_issued, gate)
                mark_issued()
                if stream is not None:
                    stream.synchronize()
        except BaseException as e:
            if not issued.done():
                issued.set_exception(e)
            raise
        return timing


def _nothing() -> None:
    pass
