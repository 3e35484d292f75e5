"""The scheduler and block manager under random workloads, driven without a model."""

from __future__ import annotations

import random
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.core.host_tier import HostTier, KVCopies
from tidal.core.kv_cache_manager import KVCacheManager
from tidal.core.request import Request, RequestStatus
from tidal.core.sampling_params import SamplingParams
from tidal.core.scheduler import Scheduler, SchedulerConfig
from tidal.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


def _fake_forward(scheduler: Scheduler, out: SchedulerOutput, rng: random.Random,
                  vocab: int) -> ModelRunnerOutput:
    """Sample a random token for each request whose whole context is now computed."""
    ids, tokens = [], []
    for req_id in out.num_scheduled_tokens:
        request = scheduler.requests[req_id]
        if request.num_computed_tokens >= request.num_tokens:
            ids.append(req_id)
            tokens.append(rng.randrange(vocab))
    return ModelRunnerOutput(ids, [[t] for t in tokens])


def run_workload(scheduler: Scheduler, pending: list[Request], rng: random.Random,
                 abort_rate: float, forward: Callable[[SchedulerOutput], ModelRunnerOutput],
                 max_steps: int = 4000) -> None:
    """Add ``pending`` a few at a time, abort some running requests at random, and step
    ``forward`` until every request is done."""
    for _ in range(max_steps):
        if pending and rng.random() < 0.5:
            scheduler.add_request(pending.pop(0))
        if scheduler.running and rng.random() < abort_rate:
            scheduler.finish_requests([rng.choice(scheduler.running).request_id],
                                      RequestStatus.FINISHED_ABORTED)
        scheduler.update_from_output(forward(scheduler.schedule()))
        if not pending and not scheduler.has_unfinished_requests():
            return
    raise AssertionError("the workload did not finish")


workload = st.fixed_dictionaries({
    "seed": st.integers(0, 2**16),
    "num_requests": st.integers(1, 24),
    "num_blocks": st.integers(8, 40),
    "block_size": st.sampled_from([2, 4, 8]),
    "budget": st.integers(1, 64),
    "max_num_seqs": st.integers(1, 8),
    "abort_rate": st.floats(0.0, 0.2),
    "caching": st.booleans(),
    "attention_cost_context": st.sampled_from([0, 1, 8, 64]),
    "clients": st.integers(1, 3),  # several: the fair share of batch slots preempts too
    "host_blocks": st.sampled_from([0, 1, 3, 8]),  # the second tier (core/host_tier.py)
    "disk_blocks": st.sampled_from([0, 1, 4, 16]),  # its disk part
    "swap": st.booleans(),  # how preempted requests resume (core/swap_policy.py)
})


class FakeTiers:
    """What each device block, host slot and disk slot holds, as the block hash its contents
    are the KV of: a step's copies move them in the runner's order, and every block a step
    reads must hold the hash of the prefix it stands for."""

    def __init__(self) -> None:
        self.device: dict[int, bytes] = {}
        self.host: dict[int, bytes] = {}
        self.disk: dict[int, bytes] = {}
        self.in_flight: set[int] = set()  # the device blocks the last step's forward used

    def run(self, scheduler: Scheduler, out: SchedulerOutput) -> None:
        self.apply(out.kv_copies)
        self.forward(scheduler, out)
        self.in_flight = {b for r in out.num_scheduled_tokens for b in scheduler.kv.block_ids(r)}

    def apply(self, copies: KVCopies | None) -> None:
        if copies is not None:
            if not copies.after_step:  # run beside the step in flight: none of its blocks
                assert copies.device_blocks().isdisjoint(self.in_flight)
            if copies.clear_disk:
                self.disk.clear()
            for host_slot, disk_slot, block_hash in copies.to_disk:
                assert self.host[host_slot] == block_hash, "a stale host slot went to disk"
                self.disk[disk_slot] = block_hash
            for block, disk_slot, block_hash in copies.out_to_disk:
                assert self.device.get(block) == block_hash, "a stale device block went to disk"
                self.disk[disk_slot] = block_hash
            for disk_slot, host_slot in copies.promote:
                self.host[host_slot] = self.disk[disk_slot]
            for block, slot in copies.out:
                self.host[slot] = self.device.get(block, b"")
            for slot, block in copies.into:
                self.device[block] = self.host[slot]
            for slot, block in copies.from_disk:
                self.device[block] = self.disk[slot]

    def forward(self, scheduler: Scheduler, out: SchedulerOutput) -> None:
        kv = scheduler.kv
        for write in (True, False):  # a forward writes its tokens' KV before attending
            for req_id, n in out.num_scheduled_tokens.items():
                request = scheduler.requests[req_id]
                blocks, hashes = kv.block_ids(req_id), request.block_hashes
                before = min((request.num_computed_tokens - n) // kv.block_size, len(hashes))
                after = min(request.num_computed_tokens // kv.block_size, len(hashes))
                for i in range(before, after) if write else ():
                    self.device[blocks[i]] = hashes[i]
                for i in () if write else range(before):  # read by the forward
                    assert self.device.get(blocks[i]) == hashes[i], "a block read wrong KV"


@settings(max_examples=60, deadline=None)
@given(workload)
def test_random_workload_finishes_everything_and_leaks_no_block(w):
    rng = random.Random(w["seed"])
    host = HostTier(w["host_blocks"], w["disk_blocks"]) if w["host_blocks"] else None
    kv = KVCacheManager(w["num_blocks"], w["block_size"], enable_caching=w["caching"],
                        host_tier=host)
    kv.swap_policy.swap = lambda *_: w["swap"]  # type: ignore[method-assign]
    tiers = FakeTiers()
    config = SchedulerConfig(w["max_num_seqs"], w["budget"], max_model_len=64,
                             attention_cost_context=w["attention_cost_context"])
    scheduler = Scheduler(config, kv)
    prefix = [rng.randrange(50) for _ in range(12)]
    requests = []
    for i in range(w["num_requests"]):
        prompt = (prefix if rng.random() < 0.5 else []) + [rng.randrange(50)
                                                           for _ in range(rng.randint(1, 40))]
        params = SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=rng.random() < 0.5,
                                stop_token_ids=[7] if rng.random() < 0.3 else [])
        requests.append(Request(str(i), prompt, params, eos_token_id=3,
                                client=str(rng.randrange(w["clients"]))))

    def forward(out: SchedulerOutput) -> ModelRunnerOutput:
        assert out.total_num_scheduled_tokens <= w["budget"]
        assert sum(out.num_scheduled_tokens.values()) == out.total_num_scheduled_tokens
        assert len(scheduler.running) <= w["max_num_seqs"]
        tiers.run(scheduler, out)
        return _fake_forward(scheduler, out, rng, 50)

    run_workload(scheduler, list(requests), rng, w["abort_rate"], forward)
    assert not scheduler.has_unfinished_requests()
    assert all(r.is_finished for r in requests)
    for r in requests:
        if r.status == RequestStatus.FINISHED_LENGTH_CAPPED:
            assert r.num_output_tokens == r.sampling_params.max_tokens or r.num_tokens >= 64
    assert kv.pool.num_free_blocks == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert not kv.req_blocks
    if kv.host is not None:  # every slot of each tier is either free or holds one block
        for table in (kv.host._host, kv.host.disk):
            if table is not None:
                held = list(table.slots.values())
                assert len(set(held)) == len(held)
                assert sorted(held + table.free) == list(range(table.num_slots))
        assert not kv._host_hits and not kv._resume_method
        assert not any(kv.host.leaked_slots().values())
        # a shutdown leaves every block on disk as far as it holds them, each slot true
        tiers.apply(kv.host.persist([(h, b.block_id) for h, b in kv.pool.cached.items()]))
        if kv.host.disk is not None:
            for block_hash, slot in kv.host.disk.slots.items():
                assert tiers.disk[slot] == block_hash


def _scheduler(num_blocks=16, block_size=4, budget=16, max_num_seqs=4, max_model_len=64):
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len), kv)


def test_long_prompt_is_chunked_while_decodes_continue():
    s = _scheduler(num_blocks=32, budget=8)
    s.add_request(Request("short", [1, 2], SamplingParams(max_tokens=10)))
    out = s.schedule()
    s.update_from_output(ModelRunnerOutput(["short"], [[5]]))
    s.add_request(Request("long", list(range(10, 30)), SamplingParams(max_tokens=2)))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"short": 1, "long": 7}
    s.update_from_output(ModelRunnerOutput(["short"], [[5]]))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"short": 1, "long": 7}


def test_chunks_are_charged_for_the_context_they_attend_over():
    """With attention_cost_context 16 a chunk of m tokens after c costs m + ceil((m c +
    m (m + 1) / 2) / 16): 11 tokens at c = 0 cost 16 (12 would cost 17), then 8 at c = 11 (16),
    6 at c = 19 (15; 7 would cost 18). The decode beside them is charged 1 token."""
    kv = KVCacheManager(64, 4)
    s = Scheduler(SchedulerConfig(4, 17, 256, attention_cost_context=16), kv)
    s.add_request(Request("short", [1, 2], SamplingParams(max_tokens=20)))
    s.schedule()
    s.update_from_output(ModelRunnerOutput(["short"], [[5]]))
    s.add_request(Request("long", list(range(100, 160)), SamplingParams(max_tokens=1)))
    chunks = []
    while s.requests["long"].num_computed_tokens < 60:
        out = s.schedule()
        assert out.num_scheduled_tokens["short"] == 1
        chunks.append(out.num_scheduled_tokens["long"])
        assert out.total_num_scheduled_tokens == 1 + chunks[-1]
        s.update_from_output(ModelRunnerOutput(["short"], [[5]]))
    assert chunks[:3] == [11, 8, 6]
    assert chunks == sorted(chunks, reverse=True) and sum(chunks) == 60
    uncharged = Scheduler(SchedulerConfig(4, 17, 256), KVCacheManager(64, 4))
    uncharged.add_request(Request("long", list(range(100, 160)), SamplingParams(max_tokens=1)))
    assert uncharged.schedule().num_scheduled_tokens == {"long": 17}


def test_a_chunk_deep_in_a_long_context_still_gets_a_token():
    s = Scheduler(SchedulerConfig(4, 4, 4096, attention_cost_context=1), KVCacheManager(600, 4))
    s.add_request(Request("long", list(range(2000)), SamplingParams(max_tokens=1)))
    steps = 0
    while s.requests["long"].num_computed_tokens < 2000:
        out = s.schedule()
        assert 1 <= out.num_scheduled_tokens["long"] <= 4
        steps += 1
    # One token a step: at attention_cost_context 1 two tokens cost 5 of the budget of 4 even
    # at the prompt's start, and one token always runs, whatever it costs.
    assert steps == 2000


def _step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    done = [r for r in out.num_scheduled_tokens
            if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens]
    s.update_from_output(ModelRunnerOutput(done, [[1]] * len(done)))
    return out


def test_preemption_recomputes_the_latest_request_and_admits_nothing_that_step():
    s = _scheduler(num_blocks=4, block_size=4, budget=32)
    s.add_request(Request("a", list(range(7)), SamplingParams(max_tokens=8)))
    s.add_request(Request("b", list(range(7)), SamplingParams(max_tokens=8)))
    _step(s)  # prefill both: 2 blocks each, the pool is full
    _step(s)  # the 8th token of each still fits
    s.add_request(Request("c", [1], SamplingParams(max_tokens=1)))
    out = _step(s)  # "a" needs a third block: "b", the latest, is preempted
    assert out.preempted_req_ids == {"b"}
    assert not out.scheduled_new_reqs  # no admission in a step that preempted
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert s.waiting[0] is b and b.num_output_tokens == 2
    while s.has_unfinished_requests():
        _step(s)
    assert s.kv.pool.num_free_blocks == 4


def test_request_that_can_never_fit_is_finished_with_an_error():
    s = _scheduler(num_blocks=2, block_size=4, max_model_len=64)
    too_long_for_cache = Request("a", list(range(5)), SamplingParams(max_tokens=20))
    assert "KV cache" in s.add_request(too_long_for_cache)
    assert too_long_for_cache.status == RequestStatus.FINISHED_ERROR
    too_long_for_model = Request("b", list(range(64)), SamplingParams(max_tokens=1))
    assert "context" in s.add_request(too_long_for_model)
    assert not s.has_unfinished_requests()


def test_stop_conditions():
    s = _scheduler(num_blocks=32)
    s.add_request(Request("eos", [1], SamplingParams(max_tokens=9), eos_token_id=3))
    s.add_request(Request("min", [1], SamplingParams(max_tokens=9, min_tokens=2), eos_token_id=3))
    s.add_request(Request("ign", [1], SamplingParams(max_tokens=2, ignore_eos=True),
                          eos_token_id=3))
    s.add_request(Request("stop", [1], SamplingParams(max_tokens=9, stop_token_ids=[8])))
    s.schedule()
    ups = s.update_from_output(ModelRunnerOutput(["eos", "min", "ign", "stop"],
                                                 [[3], [3], [3], [8]]))
    finished = {u.request.request_id: u.request for u in ups if u.finished}
    assert set(finished) == {"eos", "stop"}
    assert finished["stop"].stop_reason == 8 and finished["stop"].finish_reason == "stop"
    s.schedule()
    ups = s.update_from_output(ModelRunnerOutput(["min", "ign"], [[3], [3]]))
    assert {u.request.request_id: u.request.finish_reason for u in ups} == {
        "min": "stop", "ign": "length"}


def test_a_waiting_client_takes_a_slot_from_a_client_holding_them_all():
    """Client A's eight sequences fill the four slots; B's one request is running after the
    next step, by the preemption of A's latest, and A does not win its slot back while B
    holds its share."""
    s = _client_a_holding_the_batch()
    assert [r.request_id for r in s.running] == ["a0", "a1", "a2", "a3"]
    s.add_request(Request("b", [4, 5, 6], SamplingParams(max_tokens=50), client="B"))
    out = _step(s)
    assert "b" in out.num_scheduled_tokens and out.preempted_req_ids == {"a3"}
    assert s.preemptions_by_reason == {"fair_share": 1}
    assert sorted(r.request_id for r in s.running) == ["a0", "a1", "a2", "b"]
    for _ in range(3):
        out = _step(s)
        assert not out.preempted_req_ids and "b" in out.num_scheduled_tokens


def test_one_client_keeps_every_slot():
    s = _client_a_holding_the_batch()
    for _ in range(4):
        assert not _step(s).preempted_req_ids
    assert len(s.running) == 4


def _client_a_holding_the_batch() -> Scheduler:
    """Four slots, all taken by client A's first four of eight requests."""
    s = _scheduler(num_blocks=64, budget=32, max_num_seqs=4)
    for i in range(8):
        s.add_request(Request(f"a{i}", [1, 2, 3], SamplingParams(max_tokens=50), client="A"))
    for _ in range(3):
        assert not _step(s).preempted_req_ids
    return s
