"""Wall-clock time per engine-step phase, always on (a ``perf_counter`` call per phase)."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

PHASES = ("schedule", "grammar", "prepare_inputs", "forward", "sample", "update", "detokenize",
          "post")


@dataclass
class StepProfiler:
    """Accumulates the time between consecutive ``lap`` calls under each phase's name.

    On a GPU the device runs asynchronously, so "forward" there is launch time unless the
    runner synchronises; on the CPU it is the real compute time.
    """

    totals: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    num_steps: int = 0
    num_tokens: int = 0
    _last: float = 0.0

    def start(self) -> None:
        self._last = time.perf_counter()
        self.num_steps += 1

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.totals[phase] += now - self._last
        self._last = now

    def reset(self) -> None:
        self.totals.clear()
        self.num_steps = self.num_tokens = 0

    def breakdown(self) -> dict[str, float]:
        """Mean milliseconds per step for each phase, plus the total."""
        steps = max(self.num_steps, 1)
        out = {p: 1000 * self.totals.get(p, 0.0) / steps for p in PHASES}
        out["total"] = sum(out.values())
        return out

    def overhead_share(self) -> float:
        """The share of step time spent outside the model forward."""
        total = sum(self.totals.values())
        return 1.0 - self.totals.get("forward", 0.0) / total if total else 0.0
