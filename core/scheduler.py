"""Continuous batching in vLLM V1's style: one token budget per step, shared by decodes and
(chunked) prefills; running requests first, then waiting ones; preemption by recompute.

A prefill chunk is charged for the cached positions its tokens attend over as well as for its
tokens (``SchedulerConfig.attention_cost_context``), so a step that carries a chunk late in a
long prompt takes about as long as one with a chunk at its start, and the decodes beside it
keep their pace (charged by tokens alone, a chunk at a long prompt's end took longer).
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tidal.core.kv_cache_manager import KVCacheManager
from tidal.core.lifecycle import RateLimitedWarning
from tidal.core.request import Request, RequestStatus
from tidal.core.scheduler_in_flight import InFlight
from tidal.core.scheduler_output import NewRequestData, SchedulerOutput
from tidal.core.scheduler_sharing import BatchSharing, rank
from tidal.core.scheduler_update import RequestUpdate, StepUpdates  # noqa: F401 - re-exported
from tidal.core.service_counters import ServiceCounters
from tidal.core.spec_decode import Speculator
from tidal.core.waiting_queue import FairQueue, PriorityQueue

if TYPE_CHECKING:
    from tidal.core.speculative_config import SpeculativeConfig
    from tidal.core.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    async_scheduling: bool = False
    # The context length at which a token's attention costs as much as the rest of its
    # forward: a chunk of n tokens after c cached ones is charged n + sum(c + i) / this, over
    # i = 1..n. 0: charged n (decode rows always are).
    attention_cost_context: int = 0
    # How far (in tokens) a client may run ahead of the least-served client with work and
    # still share its steps (core/service_counters.py); 0: four full decode steps.
    client_burst_tokens: int = 0
    # "fcfs": first come, first served (by client in turn); "priority": the lowest
    # ``Request.priority`` first, preempting a running request it outranks for its place
    policy: str = "fcfs"
    speculative: SpeculativeConfig | None = None  # proposals for decoding requests
    micro_batches: int = 1  # steps the engine keeps in flight, of disjoint requests (stages)


class Scheduler(BatchSharing, InFlight, StepUpdates):
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 structured: StructuredOutputManager | None = None) -> None:
        self.config = config
        self.kv = kv
        self.structured = structured
        self.requests: dict[str, Request] = {}
        self.by_priority = config.policy == "priority"
        self.waiting: FairQueue | PriorityQueue = (PriorityQueue() if self.by_priority
                                                   else FairQueue())
        self.running: list[Request] = []
        self.in_flight: set[str] = set()  # held by a step in flight (the engine keeps it)
        self._batch_size = config.max_num_seqs  # the most requests this step (micro-batches)
        self._recent_clients: dict[str, float] = {}  # client -> when it last had work
        self.num_preemptions = 0
        self.preemptions_by_reason: Counter[str] = Counter()  # kv_cache, fair_share, priority
        self._finished_ids: set[str] = set()  # since the last schedule(): for the runner
        self._grammar_failures: list[Request] = []  # finished since the last take
        self._now = 0.0  # the clock when this step was scheduled: its requests' stamps
        self._preemption_warning = RateLimitedWarning(logger)
        self.service = ServiceCounters(config.client_burst_tokens or 4 * config.max_num_seqs)
        self.speculator = (Speculator(config.speculative, config.max_model_len,
                                      structured, config.async_scheduling)
                           if config.speculative is not None else None)
        self._spec_tokens: dict[str, list[int]] = {}  # this step's proposals

    # -- intake -------------------------------------------------------------------------
    def add_request(self, request: Request) -> str | None:
        """Queue a request; returns an error message instead if it can never run."""
        error = self._never_fits(request)
        if error:
            request.status = RequestStatus.FINISHED_ERROR
            request.error = error
            return error
        request.max_output_tokens = min(request.max_output_tokens,
                                        self.config.max_model_len - request.num_prompt_tokens)
        if request.sampling_params.structured_outputs is not None:
            assert self.structured is not None  # _never_fits refuses it otherwise
            self.structured.add(request)
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self.requests[request.request_id] = request
        self.waiting.append(request)
        request.times.queued = time.monotonic()
        return None

    def _never_fits(self, request: Request) -> str | None:
        max_len = self.config.max_model_len
        if request.sampling_params.structured_outputs is not None and self.structured is None:
            return "structured outputs are not available in this engine"
        if request.num_prompt_tokens == 0:
            return "the prompt is empty"
        if request.num_prompt_tokens >= max_len:
            return (f"the prompt has {request.num_prompt_tokens} tokens but the model's context "
                    f"is {max_len} tokens, leaving no room to generate")
        max_tokens = request.sampling_params.max_tokens
        max_tokens = max_len if max_tokens is None else max_tokens
        longest = min(request.num_prompt_tokens + max_tokens, max_len)
        if self.kv.blocks_needed(longest) > self.kv.num_blocks:
            return (f"the request may need {longest} tokens of KV cache but the whole cache "
                    f"holds {self.kv.num_blocks * self.kv.block_size}")
        return None

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus,
                        stop_reason: int | str | None = None) -> list[Request]:
        """Finish (abort, stop, error) requests from outside a step; frees their blocks."""
        done = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            self._dequeue(request)
            request.stop_reason = stop_reason
            self._finish(request, status)
            done.append(request)
        return done

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def take_grammar_failures(self) -> list[Request]:
        """Requests finished with an error because their grammar did not compile."""
        failed, self._grammar_failures = self._grammar_failures, []
        return failed

    def has_finished_to_report(self) -> bool:
        """Finished requests the runner has not been told of by a ``schedule()`` yet."""
        return bool(self._finished_ids)

    # -- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_block_ids: dict[str, list[int]] = {}
        new: list[NewRequestData] = []
        preempted: list[Request] = []
        self._now = time.monotonic()
        self._spec_tokens = {}
        if self.speculator is not None:
            self.speculator.new_step()
        clients = self._clients_with_work()
        share, self._batch_size = self._fair_share(clients), self._micro_batch_size()
        self._sitting_out = self._rows_over_step_share(clients)
        self._make_room_for_waiting_clients(share, preempted)
        if self.by_priority:
            self._make_room_for_priority(budget, preempted)
        fairness_preemptions = len(preempted)
        # under the priority policy the order is the priorities' (no step is sat out)
        allowed = None if self.by_priority else self._step_filter(share)
        budget = self._schedule_running(budget, allowed, num_scheduled, new_block_ids, preempted)
        if len(preempted) == fairness_preemptions:  # no request ran out of KV cache
            budget = self._admit_waiting(budget, num_scheduled, new, share, allowed)
        if not num_scheduled and (allowed is not None or self._sitting_out):
            self._sitting_out = set()  # those allowed could not run (no slot, say): the rest may
            self._schedule_running(budget, None, num_scheduled, new_block_ids, preempted)
        if allowed is not None:
            for req_id, n in num_scheduled.items():
                self.service.charge(self.requests[req_id].client, n)

        output = SchedulerOutput(
            scheduled_new_reqs=new, new_block_ids=new_block_ids,
            new_window_block_ids=self.kv.take_new_window_block_ids(),
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self._finished_ids,
            preempted_req_ids={r.request_id for r in preempted},
            structured_req_ids=self._constrained_sampling(num_scheduled),
            kv_copies=self.kv.take_copies(),
            scheduled_spec_decode_tokens=self._spec_tokens,
        )
        self._finished_ids = set()
        return output

    def _schedule_running(self, budget: int, allowed: Callable[[str], bool] | None,
                          num_scheduled: dict[str, int], new_block_ids: dict[str, list[int]],
                          preempted: list[Request]) -> int:
        """Schedule the running requests in order (those of ``allowed`` clients) while the
        budget lasts, preempting the latest arrivals where the KV cache runs out; returns the
        budget left."""
        i = 0
        while i < len(self.running) and budget > 0 and len(num_scheduled) < self._batch_size:
            request = self.running[i]
            if (not self._is_idle(request) or request.request_id in self._sitting_out
                    or (allowed is not None and not allowed(request.client))):
                i += 1  # in flight, over its step share, or ahead of the client furthest behind
                continue
            if request.num_output_placeholders:
                wanted = self._num_new_tokens_in_flight(request)
            else:
                wanted = request.num_tokens - request.num_computed_tokens
            drafts: list[int] = []
            if wanted == 1:  # a decode: one token (and any proposals), one each of the budget
                if self.speculator is not None:
                    drafts = self.speculator.propose(request, budget, len(self.running))
                n = cost = 1 + len(drafts)
            else:
                n, cost = self._chunk(wanted, request.num_computed_tokens, budget)
                if n <= 0:  # its last token is already being sampled by the step in flight
                    i += 1
                    continue
            if not self.kv.has_room(request, n):
                new_blocks = self._allocate_or_preempt(request, n, preempted)
                if new_blocks is None:
                    break  # the request itself was preempted
                if new_blocks:
                    new_block_ids[request.request_id] = [b.block_id for b in new_blocks]
            self._schedule_tokens(request, n, num_scheduled)
            if drafts:
                assert self.speculator is not None
                self._spec_tokens[request.request_id] = drafts
                self.speculator.scheduled(request, drafts)
            budget -= cost
            i += 1
        return budget

    def _schedule_tokens(self, request: Request, n: int, num_scheduled: dict[str, int]) -> None:
        """Count ``n`` tokens of ``request`` as computed by this step."""
        num_scheduled[request.request_id] = n
        request.num_computed_tokens += n
        request.last_scheduled = self._now
        request.times.num_steps += 1
        if (self.config.async_scheduling and request.num_computed_tokens
                >= request.num_tokens + request.num_output_placeholders):
            request.num_output_placeholders += 1

    def _constrained_sampling(self, num_scheduled: dict[str, int]) -> list[str]:
        """The constrained requests this step samples a token for (their whole known context
        is computed by it), in batch order."""
        if self.structured is None or not self.structured.num_live:
            return []
        requests = self.requests
        out = []
        for req_id in num_scheduled:
            request = requests[req_id]
            if (request.sampling_params.structured_outputs is not None
                    and request.num_computed_tokens
                    >= request.num_tokens + request.num_output_placeholders
                    - (1 if self.config.async_scheduling else 0)):
                out.append(req_id)
        return out

    def _chunk(self, wanted: int, num_computed: int, budget: int) -> tuple[int, int]:
        """(tokens to schedule, what they cost of the budget) of ``wanted`` new tokens after
        ``num_computed`` cached ones. At least one token, which may take the whole budget."""
        n = min(wanted, budget)
        k = self.config.attention_cost_context
        if n <= 1 or k <= 0:
            return n, n

        def cost(m: int) -> int:
            return m + math.ceil((m * num_computed + m * (m + 1) // 2) / k)

        # the largest m with cost(m) <= budget: the root of m^2 / 2k + m (1 + (c + 1/2) / k)
        # = budget, then stepped down past rounding
        b = 1 + (num_computed + 0.5) / k
        n = min(n, int(k * (math.sqrt(b * b + 2 * budget / k) - b)) + 1)
        while n > 1 and cost(n) > budget:
            n -= 1
        return n, min(cost(n), budget)

    def _allocate_or_preempt(self, request: Request, n: int, preempted: list[Request]):
        while True:
            new_blocks = self.kv.allocate_slots(request, n)
            if new_blocks is not None:
                return new_blocks
            victim = self._latest_idle() or request  # the latest arrival not in flight
            self.running.remove(victim)
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return None

    def _preempt(self, request: Request, reason: str = "kv_cache") -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.preemptions_by_reason[reason] += 1
        self.waiting.appendleft(request)
        request.times.events.append(("preempted", self._now))
        self._preemption_warning.warn("Request %s preempted. KV blocks freed.",
                                      request.request_id)

    def _admit_waiting(self, budget: int, num_scheduled: dict[str, int],
                       new: list[NewRequestData], share: int | None,
                       allowed: Callable[[str], bool] | None = None) -> int:
        """Admit waiting requests in order (``FairQueue``: resumed ones first, then clients
        in turn), skipping clients at their ``share`` of the batch; those whose grammar is
        still compiling keep their place without holding up the ones behind them."""
        compiling: list[Request] = []
        try:
            return self._admit(budget, num_scheduled, new, compiling, share, allowed)
        finally:
            self.waiting.putback(compiling)

    def _grammar_ready(self, request: Request) -> bool:
        """Whether a waiting request may be admitted; one whose grammar failed is finished."""
        if request.status != RequestStatus.WAITING_FOR_GRAMMAR:
            return True
        assert self.structured is not None
        ready = self.structured.resolve(request)
        if ready is True:
            request.status = RequestStatus.WAITING
            return True
        if ready is not False:  # the compile's error
            self.waiting.remove(request)
            request.error = str(ready)
            self._finish(request, RequestStatus.FINISHED_ERROR)
            self._grammar_failures.append(request)
        return False

    def _admit(self, budget: int, num_scheduled: dict[str, int], new: list[NewRequestData],
               compiling: list[Request], share: int | None,
               allowed: Callable[[str], bool] | None) -> int:
        counts = Counter(r.client for r in self.running) if share is not None else Counter()

        def below_share(client: str) -> bool:
            return share is None or (counts[client] < share
                                     and (allowed is None or allowed(client)))

        while (budget > 0 and len(self.running) < self.config.max_num_seqs
               and len(num_scheduled) < self._batch_size):
            request = self.waiting.first(below_share)
            if request is None:
                break
            if not self._grammar_ready(request):
                if request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                    self.waiting.take(request)
                    compiling.append(request)
                continue
            if request.num_output_placeholders:
                break  # preempted while a step was in flight: resume once its token is in
            # no prefix hit for a request scoring its prompt: every position must run
            hits, num_hit = (self.kv.get_computed_blocks(request)
                             if request.prompt_scores is None else ([], 0))
            n, cost = self._chunk(request.num_tokens - num_hit, num_hit, budget)
            new_blocks = self.kv.allocate_slots(request, n, hits, num_hit)
            if new_blocks is None:
                break
            self.waiting.take(request)
            counts[request.client] += 1
            times = request.times
            if request.status == RequestStatus.PREEMPTED:
                times.events.append(("resumed", self._now))
            elif times.scheduled is None:
                times.scheduled = self._now
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            if self.by_priority:  # the worst priority last, the latest arrival among equals
                bisect.insort_right(self.running, request, key=rank)
            else:
                self.running.append(request)
            new.append(NewRequestData(
                req_id=request.request_id, token_ids=list(request.all_token_ids),
                num_prompt_tokens=request.num_prompt_tokens,
                sampling_params=request.sampling_params,
                block_ids=self.kv.block_ids(request.request_id),
                num_computed_tokens=num_hit, seed=request.sampling_params.seed,
                eos_token_id=request.eos_token_id))
            self._schedule_tokens(request, n, num_scheduled)
            budget -= cost
        return budget

    def _dequeue(self, request: Request) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.times.finished = time.monotonic()
        self.kv.free(request)
        if self.structured is not None:
            self.structured.remove(request.request_id)
        if self.speculator is not None:
            self.speculator.finished(request)
        self._finished_ids.add(request.request_id)
        del self.requests[request.request_id]

