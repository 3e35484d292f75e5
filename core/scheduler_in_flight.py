"""What a step in flight means to the scheduler: under async scheduling a request may be
scheduled again while its token is still being sampled (it counts as known); with pipeline
stages the engine keeps several steps (micro-batches) in flight, and a request in one of them
(``Scheduler.in_flight``) is neither scheduled nor preempted until its tokens are back, since
its next token needs the previous step's, which only the last stage knows. A part of
``Scheduler``, kept apart so that each part reads on its own."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from tidal.core.request import Request

if TYPE_CHECKING:
    from tidal.core.scheduler import SchedulerConfig
    from tidal.core.waiting_queue import FairQueue, PriorityQueue


class InFlight:
    config: SchedulerConfig
    running: list[Request]
    waiting: FairQueue | PriorityQueue
    in_flight: set[str]  # the requests of the steps in flight (pipeline micro-batches)

    def _micro_batch_size(self) -> int:
        """The most requests one step may hold: with ``micro_batches`` steps in flight, an
        even share of the requests running or waiting, so that each step has work."""
        n = self.config.micro_batches
        if n == 1:
            return self.config.max_num_seqs
        return max(1, math.ceil((len(self.running) + len(self.waiting)) / n))

    def _is_idle(self, request: Request) -> bool:
        """Whether no step in flight holds the request (it may be scheduled or preempted)."""
        return request.request_id not in self.in_flight

    def _latest_idle(self, client: str | None = None) -> Request | None:
        """The latest running request (of ``client``) that no step in flight holds: the one
        to preempt."""
        return next((r for r in reversed(self.running)
                     if self._is_idle(r) and (client is None or r.client == client)), None)

    @staticmethod
    def _num_new_tokens_in_flight(request: Request) -> int:
        """The tokens to run for a request with tokens still being sampled (async): those
        count as known, unless the step in flight samples its last token."""
        pending = request.num_output_placeholders
        if request.num_output_tokens + pending >= request.max_output_tokens:
            return 0
        return request.num_tokens + pending - request.num_computed_tokens
