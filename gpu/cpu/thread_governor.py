"""How many threads the decode steps run on, checked while serving.

Every op of a step splits its work over all the cores and waits for the last part at its end.
When another process keeps the cores busy, one of those parts is often descheduled, and each
op waits for it to be scheduled again: a step of a few dozen ops then waits a scheduler slice
per op, and a small model's steps run tens of times slower than on a quiet host. On one thread
fewer nothing waits on a descheduled part, and the step runs at the speed of the core it gets.

So the governor compares: when the steps turn slow (a window's median ``SLOW`` times what
they ran at when the count was last chosen, as a share of their bucket's baseline,
``step_watch``) and otherwise ``FIRST_PROBE`` steps after the start, then four times as many
steps each time up to every ``PROBE_EVERY`` (a start under load has slow baselines, so only a
probe tells; a probe whose other count ran clearly slower waits the longest), it runs windows
of steps at the full thread count and at one thread fewer, alternated, and keeps the count
whose steps ran faster by more than ``MARGIN``. A co-tenant that comes and goes is followed
both ways; a quiet host keeps its full count (the probe costs a few dozen steps in thousands).
Steps are compared by their time over their bucket's baseline, so windows of different batch
shapes compare.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tidal.gpu.cpu.kernels import load_cpu_kernels

WINDOW = 8  # steps a probe window
ROUNDS = 2  # each count's windows in a probe, alternated
FIRST_PROBE = 64  # steps to the first probe; each next one four times further, up to
PROBE_EVERY = 4096  # steps between probes when nothing looks slow
SLOW = 1.5  # a window this many times its baseline: probe now
MARGIN = 0.85  # the other count is kept when its median is below this share of the current's
CLEAR = 1.2  # the other count this many times slower: no need to look again soon


logger = logging.getLogger(__name__)


def set_step_threads(n: int) -> None:
    """Run this thread's torch work on ``n`` threads, their denormals flushed as the pool's
    were (``kernels.denormals_flushed``): threads the pool starts anew would not be."""
    torch.set_num_threads(n)
    kernels = load_cpu_kernels()
    if kernels is not None:
        kernels.flush_denormals_in_pool()


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


@dataclass
class ThreadGovernor:
    """The decode steps' thread count (``set_threads`` applies one on the step's thread)."""

    full: int
    set_threads: Callable[[int], None]
    current: int = 0
    settled: float = 1.0  # the current count's steps over their baselines, when chosen
    since_probe: int = 0
    probe_after: int = FIRST_PROBE
    recent: list[float] = field(default_factory=list)
    plan: list[int] = field(default_factory=list)  # the probe's windows still to run
    probe: dict[int, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.current = self.current or self.full

    @property
    def enabled(self) -> bool:
        return self.full > 1

    def observe(self, ratio: float) -> None:
        """One decode step's time over its bucket's baseline."""
        if not self.enabled:
            return
        if self.plan:
            self._probe_step(ratio)
            return
        self.since_probe += 1
        self.recent.append(ratio)
        if len(self.recent) < WINDOW:
            return
        slow = _median(self.recent) > SLOW * self.settled
        self.recent.clear()
        if slow or self.since_probe >= self.probe_after:
            self._start_probe()

    def _start_probe(self) -> None:
        other = self.full - 1 if self.current == self.full else self.full
        self.plan = [other, self.current] * ROUNDS
        self.probe = {other: [], self.current: []}
        self.since_probe = 0
        self.probe_after = min(4 * self.probe_after, PROBE_EVERY)
        self.set_threads(self.plan[0])

    def _probe_step(self, ratio: float) -> None:
        threads = self.plan[0]
        self.probe[threads].append(ratio)
        if len(self.probe[threads]) % WINDOW:
            return
        self.plan.pop(0)
        if self.plan:
            self.set_threads(self.plan[0])
            return
        other = next(t for t in self.probe if t != self.current)
        if _median(self.probe[other]) > CLEAR * _median(self.probe[self.current]):
            self.probe_after = PROBE_EVERY  # a clear answer: the host is as it was
        if _median(self.probe[other]) < MARGIN * _median(self.probe[self.current]):
            logger.info("decode steps on %d threads from now: %.2fx faster than on %d",
                        other, _median(self.probe[self.current]) / _median(self.probe[other]),
                        self.current)
            self.current = other
        self.settled = _median(self.probe[self.current])
        self.set_threads(self.current)
