"""The engine loop's body: intake, one schedule -> execute -> update step, and stats.

``EngineCore`` is synchronous and single-threaded; ``AsyncEngine`` runs it on its own thread
and the offline ``LLM`` calls it directly.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from tidal.core.config import EngineConfig, load_tokenizer
from tidal.core.engine_stats import EngineStats
from tidal.core.executor import StepResult, create_executor
from tidal.core.host_tier import HostTier
from tidal.core.kv_cache_manager import KVCacheManager
from tidal.core.kv_window import window_group_for
from tidal.core.lifecycle import TIMEOUT, Arrival
from tidal.core.output_processor import OutputProcessor, ParentRequest
from tidal.core.outputs import RequestOutput
from tidal.core.pooling import check_runner, read_pooling_config
from tidal.core.request import Request, RequestStatus
from tidal.core.sampling_params import SamplingParams, check_token_ids, reply_budget
from tidal.core.scheduler import Scheduler, SchedulerConfig
from tidal.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from tidal.core.spec_mode import StepModes
from tidal.core.step_profiler import StepProfiler
from tidal.core.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)
# how long a step with nothing to run waits for a grammar to compile: new requests and aborts
# wait as long to be taken in
GRAMMAR_POLL_SECONDS = 0.01


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config)
        self.executor = create_executor(config)
        try:
            self._init_engine()
        except BaseException:
            self.executor.shutdown()
            raise

    def _init_engine(self) -> None:
        config, executor = self.config, self.executor
        self.max_model_len = executor.max_model_len
        self.vocab_size = executor.vocab_size
        self.eos_token_ids = self._eos_token_ids()
        num_blocks = executor.determine_num_blocks()
        executor.allocate_kv_cache(num_blocks)
        self.pooling = (read_pooling_config(config.model) if config.runner == "pooling"
                        else None)
        # mean and CLS pooling read every prompt position: no prefix-cache hit may skip one
        prefix_caching = config.enable_prefix_caching and not (
            self.pooling is not None and self.pooling.needs_every_position)
        host_blocks = executor.host_blocks()
        disk_blocks, disk_index = executor.disk_index()
        windows = executor.model_config.layer_windows()
        self.kv = KVCacheManager(num_blocks, config.block_size, prefix_caching,
                                 HostTier(host_blocks, disk_blocks, disk_index)
                                 if host_blocks else None,
                                 window_group_for(config, windows, self.max_model_len))
        if host_blocks and any(windows):
            logger.info("with the KV tier, sliding-window layers keep every block of a request")
        self.structured = StructuredOutputManager(
            self.tokenizer, self.vocab_size, self.eos_token_ids,
            compile_workers=config.grammar_compile_workers,
            compile_timeout=config.grammar_compile_timeout,
            cache_bytes=config.grammar_cache_bytes)
        self.scheduler = Scheduler(SchedulerConfig(
            config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
            async_scheduling=bool(config.async_scheduling),
            attention_cost_context=executor.attention_cost_context,
            policy=config.scheduling_policy,
            speculative=config.speculative_config,
            micro_batches=executor.max_steps_in_flight), self.kv, self.structured)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.profiler = StepProfiler()
        executor.profiler = self.profiler
        self._finished_elsewhere: list[Request] = []
        self._in_flight = None  # the launched step whose tokens are not processed yet
        # with pipeline stages: the steps in flight, oldest first, and the requests each holds
        self._pipe: deque[tuple[StepResult, list[str]]] = deque()
        # speculative decoding: which steps speculate, by measurement (core/spec_mode.py)
        speculator = self.scheduler.speculator
        self.spec_modes: StepModes | None = speculator.modes if speculator else None
        # with a second tier: each step in flight's schedule and launch time (swap_policy)
        self._launches: dict[int, tuple[SchedulerOutput, float]] = {}
        # (deadline, tie-breaker, parent) of requests with a timeout: a heap, so a step looks
        # at none but those whose time has come
        self._deadlines: list[tuple[float, int, ParentRequest]] = []
        self._deadline_order = itertools.count()
        tokens = num_blocks * config.block_size
        logger.info("KV cache: %d blocks of %d tokens (%d tokens); %.1f requests of the full "
                    "%d-token context fit", num_blocks, config.block_size, tokens,
                    tokens / self.max_model_len, self.max_model_len)

    def _eos_token_ids(self) -> list[int]:
        ids = list(self.executor.eos_token_ids)
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in ids:
            ids.insert(0, self.tokenizer.eos_token_id)
        return ids

    # -- intake -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, prompt: str | None = None,
                    arrival: Arrival | None = None) -> None:
        """Queue a request. Raises ``ValueError`` on a duplicate id or token ids outside the
        vocabulary; a request too long for the context or the KV cache is finished with an
        error on the next step. One past ``arrival``'s deadline is aborted at the next step."""
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        check_runner(self.config.runner, params)
        prompt_token_ids = check_token_ids(prompt_token_ids, self.vocab_size, "prompt token id")
        check_token_ids(list(params.logit_bias or {}), self.vocab_size, "logit_bias token id")
        arrival = arrival or Arrival()
        if arrival.priority and not self.scheduler.by_priority:
            raise ValueError("priority needs the priority scheduling policy "
                             "(--scheduling-policy priority); this engine's is fcfs")
        children = [self._child(request_id, i, list(prompt_token_ids), params, arrival)
                    for i in range(params.n)]
        parent = ParentRequest(request_id, prompt, list(prompt_token_ids),
                               {c.request_id: i for i, c in enumerate(children)})
        self.output_processor.add(parent, children)
        if arrival.deadline is not None:
            heapq.heappush(self._deadlines,
                           (arrival.deadline, next(self._deadline_order), parent))
        for child in children:
            if self.scheduler.add_request(child) is not None:
                self._finished_elsewhere.append(child)

    def _child(self, request_id: str, index: int, prompt_token_ids: list[int],
               params: SamplingParams, arrival: Arrival) -> Request:
        changes: dict = {"n": 1}
        if params.max_tokens is None:  # a prompt too long for the context is refused later
            changes["max_tokens"] = max(1, reply_budget(None, len(prompt_token_ids),
                                                        self.max_model_len))
        if params.seed is not None:
            changes["seed"] = params.choice_seed(index)
        extra_eos = [t for t in self.eos_token_ids[1:] if t not in params.stop_token_ids]
        if extra_eos and not params.ignore_eos:
            changes["stop_token_ids"] = params.stop_token_ids + extra_eos
        child_id = request_id if params.n == 1 else f"{request_id}-{index}"
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        request = Request(child_id, prompt_token_ids, params.clone(**changes), eos_token_id=eos,
                          arrival_time=arrival.time, client=arrival.client,
                          priority=arrival.priority)
        request.times.tokenized = arrival.tokenized
        return request

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        child_ids = [c for r in request_ids for c in self.output_processor.child_ids(r)]
        self._finished_elsewhere += self.scheduler.finish_requests(
            child_ids, RequestStatus.FINISHED_ABORTED)

    def _abort_expired(self) -> None:
        """Abort the requests past their deadline, ``stop_reason`` ``TIMEOUT``."""
        now = time.monotonic()
        deadlines, parents = self._deadlines, self.output_processor.parents
        while deadlines and deadlines[0][0] <= now:
            parent = heapq.heappop(deadlines)[2]
            if parents.get(parent.request_id) is parent:  # else it finished already
                self._finished_elsewhere += self.scheduler.finish_requests(
                    list(parent.children), RequestStatus.FINISHED_ABORTED, TIMEOUT)

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or bool(self._finished_elsewhere)
                or self._in_flight is not None or bool(self._pipe)
                or self.scheduler.has_finished_to_report())

    # -- one step -----------------------------------------------------------------------
    def step(self, before_forward: Callable[[], None] | None = None) -> list[RequestOutput]:
        """Run one step; returns the delta of every request that progressed or finished.

        With async scheduling, this step is launched before the previous one's tokens are
        processed, so the device computes while the host does the previous step's
        bookkeeping (the sampler counts tokens still on the device for penalties).
        ``before_forward`` runs when the step's inputs are ready, just before its forward (if
        it has one). With pipeline stages, see ``_through_pipe``.
        """
        prof = self.profiler
        prof.start()
        if self._deadlines:
            self._abort_expired()
        early, speculate = self._choose_mode()
        started = time.perf_counter()
        sched = self.scheduler.schedule()
        sched.propose_drafts = speculate  # a draft model guesses after a speculating step
        self._finished_elsewhere += self.scheduler.take_grammar_failures()
        prof.lap("schedule")
        if sched.is_empty and self._in_flight is None and not self._pipe:
            self.structured.wait_for_compiles(GRAMMAR_POLL_SECONDS)
        early += self._fill_grammar_bitmask(sched)
        launched = time.perf_counter()
        handle = self.executor.execute_model_async(sched, before_forward)  # laps its phases
        prof.num_tokens += sched.total_num_scheduled_tokens
        if self.kv.host is not None and not sched.is_empty:
            self._launches[id(handle)] = (sched, launched)
        if self.scheduler.config.micro_batches > 1:
            return early + self._through_pipe(sched, handle)
        if self.config.async_scheduling and not speculate:
            previous = self._in_flight
            self._in_flight = None if sched.is_empty else handle
            outputs = early + self._process(previous)
            if self.spec_modes is not None and previous is not None:  # a run of async steps
                self.spec_modes.observe_plain(sched, time.perf_counter() - started)
            return outputs
        speculator = self.scheduler.speculator
        accepted = speculator.stats.num_accepted_tokens if speculator is not None else 0
        outputs = early + self._process(handle)
        if speculator is not None and not sched.is_empty:  # the measures of its mode
            now = time.perf_counter()
            if speculate:
                speculator.observe_step(sched.total_num_scheduled_tokens, now - launched)
            speculator.modes.observe_step(sched, speculate, now - started,
                                          speculator.stats.num_accepted_tokens - accepted,
                                          runs_only=not self.config.async_scheduling)
        return outputs

    def _through_pipe(self, sched: SchedulerOutput, handle: StepResult) -> list[RequestOutput]:
        """With N pipeline stages, up to N steps (micro-batches) are in flight, each of
        requests no other holds (the scheduler skips those in ``in_flight``), so that every
        stage computes at once: a step's tokens are processed once the pipe is full. An empty
        step (nothing idle to run) finishes every step in flight, then itself."""
        if sched.is_empty:
            outputs = []
            while self._pipe:
                outputs += self._process_oldest()
            return outputs + self._process(handle)
        ids = list(sched.num_scheduled_tokens)
        self.scheduler.in_flight.update(ids)
        self._pipe.append((handle, ids))
        if len(self._pipe) < self.scheduler.config.micro_batches:
            return []
        return self._process_oldest()

    def _process_oldest(self) -> list[RequestOutput]:
        handle, ids = self._pipe.popleft()
        outputs = self._process(handle)
        self.scheduler.in_flight.difference_update(ids)
        return outputs

    def _choose_mode(self) -> tuple[list[RequestOutput], bool]:
        """Whether this step speculates (as measured to pay: ``core/spec_mode.py``); if it
        does, the step in flight is processed first, so the proposals follow the newest
        tokens, and its outputs are returned."""
        if self.spec_modes is None:
            return [], False
        speculator = self.scheduler.speculator
        assert speculator is not None
        speculator.active = self.spec_modes.choose(self.scheduler.running)
        if not speculator.active or self._in_flight is None:
            return [], speculator.active
        previous, self._in_flight = self._in_flight, None
        return self._process(previous), True

    def _fill_grammar_bitmask(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """The bitmask of the constrained rows this step samples. Their matchers must first
        take the tokens of the step in flight (async scheduling), so that step is processed
        now, before this one launches; its outputs are returned."""
        if not sched.structured_req_ids:
            return []
        early = []
        if self._in_flight is not None:
            previous, self._in_flight = self._in_flight, None
            early = self._process(previous)
        sched.grammar_bitmask = self.structured.bitmask(sched.structured_req_ids,
                                                      sched.scheduled_spec_decode_tokens)
        self.profiler.lap("grammar")
        return early

    def step_modes(self) -> contextlib.AbstractContextManager[None]:
        """Hold the device's step modes on this thread for a run of steps, rather than
        entering them in every step (see ``ModelRunner.step_modes``)."""
        return self.executor.step_modes()

    def release_host_memory(self) -> None:
        """Give the OS back the host memory the last steps' temporaries left with the C
        allocator (an idle engine's; the next busy steps take it again)."""
        self.executor.release_host_memory()

    def shutdown(self) -> None:
        """Leave the KV tier's prefixes on disk (``--kv-offload-path``), then release the
        executor's workers (a tensor-parallel group's processes)."""
        try:
            host = self.kv.host if hasattr(self, "kv") else None
            copies = host.persist([(h, b.block_id) for h, b in self.kv.pool.cached.items()]
                                  ) if host is not None else None
            if copies:
                self.executor.apply_kv_copies(copies)
        finally:
            self.executor.shutdown()

    def _result(self, handle: StepResult) -> ModelRunnerOutput:
        """A step's tokens; with a second tier, what the step measured for the choice between
        swapping and recomputing (``core/swap_policy.py``): its prefill time per token, from
        launch to tokens, and the copies' time per block."""
        out = handle.result()
        sched, launched = self._launches.pop(id(handle), (None, 0.0))
        if sched is not None:
            policy = self.kv.swap_policy
            if sched.total_num_scheduled_tokens > len(sched.num_scheduled_tokens):  # prefill
                policy.record_prefill(sched.total_num_scheduled_tokens,
                                      time.perf_counter() - launched)
            if sched.kv_copies and (sched.kv_copies.into or sched.kv_copies.from_disk):
                policy.record_copies(self.executor.take_kv_copy_timing())
        return out

    def _process(self, handle: StepResult | None) -> list[RequestOutput]:
        """Apply a step's sampled tokens: stop checks, detokenization, deltas."""
        updates = self.scheduler.update_from_output(self._result(handle)) if handle else []
        self.profiler.lap("update")
        finished, self._finished_elsewhere = self._finished_elsewhere, []
        outputs = self.output_processor.process(updates, finished, self._stop)
        self.profiler.lap("detokenize")
        return outputs

    def _stop(self, request: Request, status: RequestStatus, reason: str | None) -> None:
        if request.is_finished:
            return
        self.scheduler.finish_requests([request.request_id], status, reason)

    def stats(self) -> EngineStats:
        kv = self.kv
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=kv.usage(), prefix_cache_queries=kv.stats.queries,
            prefix_cache_hits=kv.stats.hits, num_preemptions=self.scheduler.num_preemptions,
            num_free_blocks=kv.pool.num_free_blocks, num_total_blocks=kv.num_blocks,
            num_waiting_clients=self.scheduler.waiting.num_clients,
            max_waiting_per_client=self.scheduler.waiting.max_per_client,
            grammar_cache_bytes=self.structured.compiler.cache_size,
            grammar_compile_timeouts=self.structured.compiler.num_timeouts,
            preemptions_by_reason=dict(self.scheduler.preemptions_by_reason),
            **self._host_tier_stats(), **self._spec_stats())

    def _host_tier_stats(self) -> dict[str, object]:
        host = self.kv.host
        if host is None:
            return {}
        stats = host.stats
        return {"host_tier_blocks": host.num_blocks, "host_tier_used": host.num_used,
                "host_tier_stored": stats.stored, "host_tier_hits": stats.hits,
                "disk_tier_blocks": host.num_disk_blocks, "disk_tier_used": host.num_used_disk,
                "disk_tier_stored": stats.disk_stored, "disk_tier_hits": stats.disk_hits,
                "swapped_out_blocks": stats.stored + stats.disk_direct,
                "resumptions_by_method": dict(self.kv.swap_policy.resumptions),
                "resumption_cost_per_token": self.kv.swap_policy.costs(self.kv.block_size)}

    def _spec_stats(self) -> dict[str, Any]:
        speculator = self.scheduler.speculator
        if speculator is None:
            return {}
        stats = speculator.stats
        return {"spec_decode_num_drafts": stats.num_drafts,
                "spec_decode_num_draft_tokens": stats.num_draft_tokens,
                "spec_decode_num_accepted_tokens": stats.num_accepted_tokens,
                "spec_decode_accepted_per_pos": tuple(stats.accepted_per_pos),
                "spec_decode_num_trimmed_tokens": stats.num_trimmed_tokens}

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache between steps (``KVCacheManager.reset_prefix_cache``)."""
        return self.kv.reset_prefix_cache()
