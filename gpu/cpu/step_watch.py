"""Live decode steps watched for drift: where the steps a server runs become persistently
slower than the same steps ran when its plans came in (a co-tenant came, the clock dropped, a
candidate drifted), the plans no longer describe the host, and they are timed again
(``model_upgrade``).

Steps are compared with steps: decode-only steps in buckets of their row count and their mean
context (powers of two), each bucket's first window of ``WINDOW`` steps after the plans came
in its baseline. A plan's own timings are no baseline for whole steps: they read one layer's
KV cache in every layer (``op_plans.plan_decode_stack``), which stays in the CPU's caches as
a real step's does not.

Each step's time over its bucket's baseline also goes to the ``ThreadGovernor``, which runs the
steps on one thread fewer while a co-tenant makes that faster.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tidal.gpu.cpu.thread_governor import ThreadGovernor, set_step_threads

SLOW = 1.5  # a window's median this many times its bucket's baseline: a slow window
WINDOW = 32  # decode steps a window
PERSIST = 4  # slow windows in a row that make the steps persistently slow


def bucket(n: float) -> int:
    """The power of two at or above ``n``."""
    b = 1
    while b < n:
        b *= 2
    return b


class StepWatch:
    """Decode steps' times, a window at a time, per (rows, context) bucket."""

    def __init__(self, threads: int = 0,
                 set_threads: Callable[[int], None] = set_step_threads) -> None:
        self.governor = ThreadGovernor(threads or torch.get_num_threads(), set_threads)
        self.reset()

    def reset(self) -> None:
        """New plans: new baselines."""
        self.windows: dict[tuple[int, int], list[float]] = {}
        self.baseline: dict[tuple[int, int], float] = {}
        self.slow: dict[tuple[int, int], int] = {}

    def observe(self, rows: int, mean_context: float, ms: float) -> bool:
        """Record one decode step; True once its bucket ran ``PERSIST`` slow windows in a
        row (then every bucket starts afresh)."""
        key = (bucket(rows), bucket(mean_context))
        window = self.windows.setdefault(key, [])
        window.append(ms)
        if key in self.baseline:
            self.governor.observe(ms / self.baseline[key])
        if len(window) < WINDOW:
            return False
        median = sorted(window)[WINDOW // 2]
        window.clear()
        base = self.baseline.setdefault(key, median)
        self.slow[key] = self.slow.get(key, 0) + 1 if median > SLOW * base else 0
        if self.slow[key] < PERSIST:
            return False
        self.reset()
        return True
