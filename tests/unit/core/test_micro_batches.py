"""The scheduler with several steps in flight (pipeline stages' micro-batches), driven as the
engine drives it, without a model: no request is scheduled or preempted while a step in
flight holds it, each step takes its share of the requests, and random workloads (aborts of
requests in flight, preemption, clients' fair shares, priorities) finish without a leaked
block."""

from __future__ import annotations

import random
from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.core.test_scheduler import FakeTiers, _fake_forward
from tidal.core.kv_cache_manager import KVCacheManager
from tidal.core.request import Request, RequestStatus
from tidal.core.sampling_params import SamplingParams
from tidal.core.scheduler import Scheduler, SchedulerConfig
from tidal.core.scheduler_output import ModelRunnerOutput


def _pipe_scheduler(depth: int, num_blocks: int = 64, max_num_seqs: int = 8,
                    policy: str = "fcfs", budget: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, budget, 128, policy=policy,
                                     micro_batches=depth), KVCacheManager(num_blocks, 4))


def test_steps_in_flight_hold_disjoint_shares_of_the_requests():
    s = _pipe_scheduler(depth=2)
    for i in range(5):
        s.add_request(Request(str(i), [1, 2, 3], SamplingParams(max_tokens=4)))
    first = s.schedule()
    assert len(first.num_scheduled_tokens) == 3  # ceil(5 / 2)
    s.in_flight.update(first.num_scheduled_tokens)
    second = s.schedule()
    assert set(second.num_scheduled_tokens) == {"3", "4"}
    s.in_flight.update(second.num_scheduled_tokens)
    assert s.schedule().is_empty  # every request is in flight: nothing to run
    s.update_from_output(ModelRunnerOutput(list(first.num_scheduled_tokens),
                                           [[7]] * 3))
    s.in_flight.difference_update(first.num_scheduled_tokens)
    third = s.schedule()
    assert set(third.num_scheduled_tokens) == set(first.num_scheduled_tokens)
    assert all(n == 1 for n in third.num_scheduled_tokens.values())  # their decodes


def test_a_request_in_flight_is_never_the_one_preempted():
    """Two requests fill the cache, a block each; the later one is in flight, so the earlier
    one, short of a block for its next token, preempts itself rather than it."""
    s = _pipe_scheduler(depth=2, num_blocks=2)
    for name in "ab":
        s.add_request(Request(name, [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True)))
    assert list(s.schedule().num_scheduled_tokens) == ["a"]  # one request a step
    s.in_flight.add("a")
    assert list(s.schedule().num_scheduled_tokens) == ["b"]
    s.in_flight.add("b")
    s.update_from_output(ModelRunnerOutput(["a"], [[9]]))
    s.in_flight.discard("a")
    assert s.schedule().num_scheduled_tokens == {"a": 1}  # its 4th token: the block's last
    s.update_from_output(ModelRunnerOutput(["a"], [[9]]))
    out = s.schedule()  # a's 5th token needs a block; b holds the other and is in flight
    assert out.preempted_req_ids == {"a"} and not out.num_scheduled_tokens
    assert s.requests["b"].status == RequestStatus.RUNNING


@settings(max_examples=40, deadline=None)
@given(st.fixed_dictionaries({
    "seed": st.integers(0, 2**16),
    "depth": st.sampled_from([2, 3]),
    "num_requests": st.integers(1, 16),
    "num_blocks": st.integers(10, 40),
    "budget": st.integers(1, 48),
    "max_num_seqs": st.integers(1, 8),
    "abort_rate": st.floats(0.0, 0.2),
    "caching": st.booleans(),
    "clients": st.integers(1, 3),
    "policy": st.sampled_from(["fcfs", "priority"]),
}))
def test_random_workloads_in_micro_batches_finish(w):
    rng = random.Random(w["seed"])
    kv = KVCacheManager(w["num_blocks"], 4, enable_caching=w["caching"])
    scheduler = Scheduler(SchedulerConfig(w["max_num_seqs"], w["budget"], max_model_len=64,
                                          policy=w["policy"], micro_batches=w["depth"]), kv)
    tiers = FakeTiers()
    pending = [Request(str(i), [rng.randrange(50) for _ in range(rng.randint(1, 30))],
                       SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True),
                       client=str(rng.randrange(w["clients"])),
                       priority=rng.randrange(3) if w["policy"] == "priority" else 0)
               for i in range(w["num_requests"])]
    requests = list(pending)
    pipe: deque[tuple[ModelRunnerOutput, list[str]]] = deque()
    for _ in range(4000):
        if pending and rng.random() < 0.5:
            scheduler.add_request(pending.pop(0))
        if scheduler.running and rng.random() < w["abort_rate"]:  # in flight or not
            scheduler.finish_requests([rng.choice(scheduler.running).request_id],
                                      RequestStatus.FINISHED_ABORTED)
        out = scheduler.schedule()
        held = scheduler.in_flight
        assert not held & set(out.num_scheduled_tokens), "a request in flight was scheduled"
        assert not held & out.preempted_req_ids, "a request in flight was preempted"
        assert all(scheduler.requests[r].status == RequestStatus.RUNNING for r in held
                   if r in scheduler.requests)
        if not out.is_empty:  # launched: the device runs it, its tokens come back later
            tiers.run(scheduler, out)
            ids = list(out.num_scheduled_tokens)
            pipe.append((_fake_forward(scheduler, out, rng, 50), ids))
            held.update(ids)
        while pipe and (out.is_empty or len(pipe) >= w["depth"]):
            result, ids = pipe.popleft()
            scheduler.update_from_output(result)
            held.difference_update(ids)
        if not pending and not pipe and not scheduler.has_unfinished_requests():
            break
    else:
        raise AssertionError("the workload did not finish")
    assert all(r.is_finished for r in requests)
    assert kv.pool.num_free_blocks == kv.num_blocks and not kv.req_blocks
