"""The priority policy: the lowest priority value runs first, a waiting request preempts the
running ones it outranks when the batch or the KV cache is full, and equal priorities keep
first come, first served (core/waiting_queue.py ``PriorityQueue``, core/scheduler.py)."""

from __future__ import annotations

import random

import pytest

from tests.unit.core.test_scheduler import _fake_forward, _step, run_workload
from tidal.core.kv_cache_manager import KVCacheManager
from tidal.core.request import Request, RequestStatus
from tidal.core.sampling_params import SamplingParams
from tidal.core.scheduler import Scheduler, SchedulerConfig
from tidal.core.waiting_queue import PriorityQueue


def _request(req_id: str, priority: int, arrival: float, client: str = "",
             prompt_len: int = 3, max_tokens: int = 50) -> Request:
    return Request(req_id, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                   arrival_time=arrival, client=client, priority=priority)


def test_the_queue_takes_the_lowest_value_first_then_clients_in_turn():
    queue = PriorityQueue()
    for req_id, priority, arrival, client in [("late-low", 5, 0.0, "A"), ("a1", 0, 1.0, "A"),
                                              ("a2", 0, 2.0, "A"), ("b1", 0, 3.0, "B"),
                                              ("mid", 1, 4.0, "B")]:
        queue.append(_request(req_id, priority, arrival, client))
    assert [r.request_id for r in queue] == ["a1", "b1", "a2", "mid", "late-low"]
    assert len(queue) == 5 and queue.num_clients == 2 and queue.max_per_client == 3
    taken = [queue.popleft().request_id for _ in range(5)]
    assert taken == ["a1", "b1", "a2", "mid", "late-low"]
    assert not queue


def test_a_preempted_request_goes_back_ahead_of_what_it_outranks_in_arrival_order():
    queue = PriorityQueue()
    queue.append(_request("new", 1, 10.0))
    queue.append(_request("better", 0, 11.0))
    for req_id, arrival in [("p2", 2.0), ("p1", 1.0)]:  # preempted latest first
        request = _request(req_id, 1, arrival)
        request.status = RequestStatus.PREEMPTED
        queue.appendleft(request)
    assert [r.request_id for r in queue] == ["better", "p1", "p2", "new"]


def _scheduler(max_num_seqs: int = 2, num_blocks: int = 64, budget: int = 32) -> Scheduler:
    config = SchedulerConfig(max_num_seqs, budget, max_model_len=256, policy="priority")
    return Scheduler(config, KVCacheManager(num_blocks, block_size=4))


def test_a_higher_priority_preempts_the_worst_running_when_the_batch_is_full():
    s = _scheduler(max_num_seqs=2)
    s.add_request(_request("low-early", 5, 1.0, max_tokens=200))
    s.add_request(_request("low-late", 5, 2.0))
    for _ in range(3):
        _step(s)
    s.add_request(_request("urgent", 0, 3.0, max_tokens=5))
    out = _step(s)
    assert out.preempted_req_ids == {"low-late"}
    assert s.preemptions_by_reason == {"priority": 1}
    assert "urgent" in out.num_scheduled_tokens
    assert [r.request_id for r in s.running] == ["urgent", "low-early"]
    s.add_request(_request("low-later", 5, 4.0))  # arrives after the preempted one
    while "urgent" in s.requests:
        _step(s)
    out = _step(s)  # one slot free: the preempted one resumes before a later arrival
    assert "low-late" in out.num_scheduled_tokens
    assert "low-later" not in out.num_scheduled_tokens


def test_a_higher_priority_preempts_when_the_kv_cache_is_full():
    s = _scheduler(max_num_seqs=8, num_blocks=8, budget=64)  # 32 tokens of cache
    s.add_request(_request("low", 5, 1.0, prompt_len=24, max_tokens=8))
    _step(s)
    s.add_request(_request("urgent", 0, 2.0, prompt_len=12, max_tokens=4))
    out = _step(s)
    assert out.preempted_req_ids == {"low"} and "urgent" in out.num_scheduled_tokens


def test_equal_priorities_do_not_preempt_each_other():
    s = _scheduler(max_num_seqs=2)
    for i in range(4):
        s.add_request(_request(f"r{i}", 1, float(i), max_tokens=5))
    order = []
    while s.has_unfinished_requests():
        out = _step(s)
        assert not out.preempted_req_ids
        order += [r for r in out.num_scheduled_tokens if r not in order]
    assert order == ["r0", "r1", "r2", "r3"]


def test_a_lower_priority_waits_and_is_not_starved_for_ever():
    s = _scheduler(max_num_seqs=1)
    s.add_request(_request("low", 9, 0.0, max_tokens=3))
    for i in range(3):
        s.add_request(_request(f"high{i}", 0, 1.0 + i, max_tokens=3))
    finished = []
    while s.has_unfinished_requests():
        before = set(s.requests)
        _step(s)
        finished += sorted(before - set(s.requests))
    assert finished == ["high0", "high1", "high2", "low"]


@pytest.mark.parametrize("seed", range(6))
def test_random_priorities_finish_everything_and_leak_no_block(seed: int):
    rng = random.Random(seed)
    s = _scheduler(max_num_seqs=rng.randint(1, 6), num_blocks=rng.randint(12, 40),
                   budget=rng.randint(4, 48))
    pending = [_request(f"r{i}", rng.randint(0, 3), float(i), client=str(rng.randrange(3)),
                        prompt_len=rng.randint(1, 20), max_tokens=rng.randint(1, 12))
               for i in range(24)]
    run_workload(s, pending, rng, 0.05, lambda out: _fake_forward(s, out, rng, 50))
    assert s.kv.pool.num_free_blocks == s.kv.num_blocks
    assert not s.running and not s.waiting
