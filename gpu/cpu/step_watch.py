"""Live decode steps held against their plans: where the steps a server runs are persistently
slower than its plans said they would be, the plans no longer describe the host (a co-tenant
came, the clock dropped, a candidate drifted), and they are timed again (``model_upgrade``).

Only decode-only steps are compared, and only where their mean context is near the one the plan
was timed at (``op_plans.DECODE_CONTEXT``): the one-call decode step's plan times whole steps
of so many rows there (``CpuBackend.expected_decode_ms``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from tidal.gpu.cpu.op_plans import DECODE_CONTEXT

SLOW = 1.5  # a window's median step this many times its planned time: slower than planned
WINDOW = 64  # decode steps compared at a time


class StepWatch:
    """Decode steps' times over their planned times, a window at a time."""

    def __init__(self, expected_ms: Callable[[int], float | None]) -> None:
        self.expected_ms = expected_ms
        self.ratios: deque[float] = deque(maxlen=WINDOW)

    def observe(self, rows: int, mean_context: float, ms: float) -> bool:
        """Record one decode step; True once a full window ran slower than planned (the
        window then starts afresh)."""
        if mean_context > 2 * DECODE_CONTEXT:
            return False
        expected = self.expected_ms(rows)
        if not expected:
            return False
        self.ratios.append(ms / expected)
        if len(self.ratios) < WINDOW:
            return False
        slow = sorted(self.ratios)[WINDOW // 2] > SLOW
        if slow:
            self.ratios.clear()
        return slow
