"""A request's lifecycle as the engine stamps it, and what a finished request reports of it.

The server stamps ``Arrival`` (the request reached it, its prompt was tokenized); the scheduler
stamps the rest at each state change (queued, first scheduled, first token, each preemption and
resumption, finished) from one clock read per step, so the stamps cost nothing per token. When a
request finishes, ``RequestStats`` is a snapshot of them the event loop may read: the phases in
vLLM's vocabulary, for the server's histograms, its trace log and its spans.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

# Request.stop_reason of a request aborted because it ran past its timeout
TIMEOUT = "timeout"


@dataclass(frozen=True, slots=True)
class Arrival:
    """When a request reached the server and its prompt was ready (``time.monotonic``), how
    long it may wait and run from its arrival (None: no limit), who sent it (the scheduler's
    fairness between clients; "" for all alike) and its priority."""

    time: float = field(default_factory=time.monotonic)
    tokenized: float | None = None
    timeout: float | None = None
    client: str = ""
    priority: int = 0  # under --scheduling-policy priority: the lower, the sooner

    @property
    def deadline(self) -> float | None:
        return None if self.timeout is None else self.time + self.timeout


@dataclass(slots=True)
class RequestTimes:
    """The stamps of one engine request (one of ``n`` choices)."""

    arrival: float
    tokenized: float | None = None
    queued: float | None = None
    scheduled: float | None = None  # the first time
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    # ("preempted" | "resumed", time), in order
    events: list[tuple[str, float]] = field(default_factory=list)
    num_steps: int = 0  # steps that ran some of its tokens


@dataclass(frozen=True, slots=True)
class RequestStats:
    """A finished engine request: its stamps, token counts and preemptions."""

    request_id: str
    finish_reason: str | None
    times: RequestTimes
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    timed_out: bool = False

    def phases(self) -> list[tuple[str, float]]:
        """Every stamp, in the order it happened."""
        t = self.times
        named = [("arrival", t.arrival), ("tokenized", t.tokenized), ("queued", t.queued),
                 ("scheduled", t.scheduled), ("first_token", t.first_token),
                 *t.events, ("last_token", t.last_token), ("finished", t.finished)]
        return sorted(((name, at) for name, at in named if at is not None),
                      key=lambda item: item[1])

    # vLLM's intervals (vllm/v1/metrics/stats.py); None where the request never got there
    @property
    def queue_time(self) -> float | None:
        return _between(self.times.queued, self.times.scheduled)

    @property
    def prefill_time(self) -> float | None:
        return _between(self.times.scheduled, self.times.first_token)

    @property
    def decode_time(self) -> float | None:
        return _between(self.times.first_token, self.times.last_token)

    @property
    def inference_time(self) -> float | None:
        return _between(self.times.scheduled, self.times.last_token)

    @property
    def time_per_output_token(self) -> float | None:
        decode = self.decode_time
        if decode is None or self.num_generation_tokens < 2:
            return None
        return decode / (self.num_generation_tokens - 1)


def _between(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


class RateLimitedWarning:
    """Logs a warning at most once per ``interval`` seconds, counting the ones held back: a
    KV cache under pressure preempts every step, and a line per preemption would flood the
    log and slow the engine thread that writes it."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self.logger = logger
        self.interval = interval
        self._last = -float("inf")
        self._held = 0

    def warn(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last < self.interval:
            self._held += 1
            return
        if self._held:
            message += " (%d more since the last warning)"
            args = (*args, self._held)
        self.logger.warning(message, *args)
        self._last, self._held = now, 0
