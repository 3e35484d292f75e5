"""How the scheduler shares the batch: between clients (a fair share of the slots, and of each
step by tokens: ``core/service_counters.py``) and, under the priority policy, by priority
(docs/scheduler.md, docs/robustness.md). A part of ``Scheduler``, kept apart so that each
rule reads on its own."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from tidal.core.request import Request, RequestStatus
from tidal.core.service_counters import ServiceCounters

# how long a client counts as present after its last request ended (``_rows_over_step_share``)
RECENT_CLIENT_SECONDS = 2.0

if TYPE_CHECKING:
    from tidal.core.kv_cache_manager import KVCacheManager
    from tidal.core.scheduler import SchedulerConfig
    from tidal.core.waiting_queue import FairQueue, PriorityQueue


class BatchSharing:
    config: SchedulerConfig
    kv: KVCacheManager
    running: list[Request]
    waiting: FairQueue | PriorityQueue
    service: ServiceCounters
    _preempt: Callable[[Request, str], None]  # the scheduler's (the request, why)
    _now: float
    _recent_clients: dict[str, float]
    _sitting_out: set[str] = set()  # over their client's step share; replaced, never mutated
    _latest_idle: Callable[..., Request | None]  # core/scheduler_in_flight.py's

    def _make_room_for_priority(self, budget: int, preempted: list[Request]) -> None:
        """With the batch full, or too few free KV blocks for its first chunk (counted
        without prefix hits), the waiting request of the best priority preempts the running
        request of the worst (the latest arrival among equals) while it outranks it. The
        running list is kept in order of priority, so that one is the last."""
        while self.waiting and (worst := self._latest_idle()) is not None:
            head = self.waiting.peek()  # ``worst``: the worst priority that is not in flight
            if head.priority >= worst.priority or head.status == RequestStatus.WAITING_FOR_GRAMMAR:
                return
            needed = self.kv.blocks_needed(min(head.num_tokens, budget))
            if (len(self.running) < self.config.max_num_seqs
                    and needed <= self.kv.pool.num_free_blocks):
                return
            self.running.remove(worst)
            self._preempt(worst, "priority")
            preempted.append(worst)

    def _clients_with_work(self) -> set[str]:
        return {r.client for r in self.running}.union(self.waiting.clients)

    def _fair_share(self, clients: set[str]) -> int | None:
        """The batch slots each client may hold while several (``clients``) have requests
        running or waiting (None with one client: it may take them all)."""
        if len(clients) <= 1:
            return None
        return max(1, self.config.max_num_seqs // len(clients))

    def _rows_over_step_share(self, clients: set[str]) -> set[str]:
        """The running requests that sit this step out: while other clients have had work
        within ``RECENT_CLIENT_SECONDS``, a client's requests fill at most its fair share of
        the step's slots, those scheduled longest ago first (round-robin). A step then stays
        short for the request another client sends next, which has to wait for the step in
        flight when it arrives; a client alone keeps the whole batch."""
        now, seen = self._now, self._recent_clients
        for client in clients:
            seen[client] = now
        for gone in [c for c, at in seen.items() if now - at > RECENT_CLIENT_SECONDS]:
            del seen[gone]
        if len(seen) <= 1:
            return set()
        share = max(1, self.config.max_num_seqs // len(seen))
        by_client: dict[str, list[Request]] = {}
        for request in self.running:
            by_client.setdefault(request.client, []).append(request)
        out: set[str] = set()
        for requests in by_client.values():
            if len(requests) > share:
                requests.sort(key=lambda r: r.last_scheduled)
                out.update(r.request_id for r in requests[share:])
        return out

    def _step_filter(self, share: int | None) -> Callable[[str], bool] | None:
        """Which clients run this step (``ServiceCounters``); None: all of them."""
        if share is None:  # one client with work, or none: kept as the one to start behind
            alone = self.running[0].client if self.running else next(iter(self.waiting.clients),
                                                                     None)
            return self.service.step_filter({} if alone is None else {alone: 0})
        demand = Counter(r.client for r in self.running)
        if len(self.running) < self.config.max_num_seqs:  # a waiting client can be admitted
            for client in self.waiting.clients:
                demand[client] += 1
        return self.service.step_filter(demand)

    def _make_room_for_waiting_clients(self, share: int | None,
                                       preempted: list[Request]) -> None:
        """With the batch full, each waiting client below its fair share of the slots takes
        one from the client most above it: that client's latest request is preempted (its
        KV recomputed, or found in the prefix cache, when it resumes). One client's flood of
        sequences then delays another client's request by a step, not by the flood's whole
        generation."""
        if share is None or len(self.running) < self.config.max_num_seqs:
            return
        counts = Counter(r.client for r in self.running)
        for client in self.waiting.clients:
            if counts[client] >= share:
                continue
            greedy, most = counts.most_common(1)[0]
            if most <= share:
                return
            victim = self._latest_idle(greedy)
            if victim is None:  # all of its requests are in flight (pipeline micro-batches)
                return
            self.running.remove(victim)
            self._preempt(victim, "fair_share")
            preempted.append(victim)
            counts[greedy] -= 1
            counts[client] += 1  # the slot it is about to take


def rank(request: Request) -> tuple[int, float]:
    """The order of the priority policy: the lowest priority value, then the earliest."""
    return request.priority, request.arrival_time
