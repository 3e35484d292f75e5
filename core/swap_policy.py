"""Swap or recompute: how a preempted request gets back the KV blocks that left the device.

Its blocks that are still in the second tier (host memory or disk) can be copied back, or
computed again by a prefill. Which is cheaper depends on the machine, so both are measured
live: the copy thread times each step's copies in, per block and tier (``Executor.
take_kv_copy_timing``), and the engine times the steps that prefill, per token scheduled. A
resumption copies when the measured copy time of its blocks is below the measured prefill
time of their tokens; until both are measured it copies (which measures the copies).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# weight of the newest measurement in the running means
_SMOOTHING = 0.2


@dataclass
class RunningMean:
    value: float | None = None

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else (
            (1 - _SMOOTHING) * self.value + _SMOOTHING * sample)


@dataclass
class SwapPolicy:
    # seconds per block copied back into the device, per tier ("host", "disk")
    copy_per_block: dict[str, RunningMean] = field(
        default_factory=lambda: {"host": RunningMean(), "disk": RunningMean()})
    prefill_per_token: RunningMean = field(default_factory=RunningMean)
    resumptions: Counter[str] = field(default_factory=Counter)  # by method: swap, recompute

    def record_copies(self, timing: dict[str, tuple[int, float]]) -> None:
        """A step's copies in: ``tier -> (blocks, seconds)``."""
        for tier, (blocks, seconds) in timing.items():
            if blocks and tier in self.copy_per_block:
                self.copy_per_block[tier].add(seconds / blocks)

    def record_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0:
            self.prefill_per_token.add(seconds / num_tokens)

    def swap(self, num_host: int, num_disk: int, block_size: int) -> bool:
        """Whether to copy ``num_host`` + ``num_disk`` blocks back rather than recompute
        them (the caller counts the resumption once it is admitted)."""
        costs = self.costs(block_size)
        if "recompute" not in costs or any(
                blocks and f"swap_{tier}" not in costs
                for tier, blocks in (("host", num_host), ("disk", num_disk))):
            return True  # unmeasured: copy, which measures it
        copy = num_host * costs.get("swap_host", 0.0) + num_disk * costs.get("swap_disk", 0.0)
        return copy <= costs["recompute"] * (num_host + num_disk)

    def costs(self, block_size: int) -> dict[str, float]:
        """The measured seconds per token brought back, by way ("swap_host", "swap_disk",
        "recompute"), those measured so far: what the choice compares (the metrics')."""
        out = {f"swap_{tier}": mean.value / block_size
               for tier, mean in self.copy_per_block.items() if mean.value is not None}
        if "swap_disk" in out:  # read into host memory, then copied in from there
            out["swap_disk"] += out.get("swap_host", 0.0)
        if self.prefill_per_token.value is not None:
            out["recompute"] = self.prefill_per_token.value
        return out
