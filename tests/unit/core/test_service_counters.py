"""Steps shared fairly between clients: a client with one sequence is not made to wait in
steps as wide as another client's flood (core/service_counters.py), and beside a client with
recent work, a flood's steps hold its share of the slots (core/scheduler_sharing.py)."""

from __future__ import annotations

from collections import Counter

from tests.unit.core.test_scheduler import _step
from tidal.core.kv_cache_manager import KVCacheManager
from tidal.core.request import Request
from tidal.core.sampling_params import SamplingParams
from tidal.core.scheduler import Scheduler, SchedulerConfig
from tidal.core.scheduler_sharing import RECENT_CLIENT_SECONDS
from tidal.core.service_counters import ServiceCounters


def test_one_client_is_never_held_back():
    counters = ServiceCounters(burst=8)
    assert counters.step_filter({"A": 60}) is None
    assert counters.step_filter({}) is None


def test_a_newcomer_starts_behind_and_the_flood_sits_out_until_it_catches_up():
    counters = ServiceCounters(burst=8)
    assert counters.step_filter({"A": 60}) is None  # A alone, then B arrives
    allowed = counters.step_filter({"A": 60, "B": 1})  # B starts 8 + 60 behind A
    assert allowed("B") and not allowed("A")
    counters.charge("B", 8)  # its burst of 8 tokens in steps of its own
    assert not counters.step_filter({"A": 60, "B": 1})("A")
    counters.charge("B", 60)  # B has now had as many tokens as A since B arrived
    allowed = counters.step_filter({"A": 60, "B": 1})
    assert allowed("A"), "the least-served client always runs"
    assert allowed("B"), "B is within the burst of A"
    counters.charge("A", 60)
    counters.charge("B", 1)
    allowed = counters.step_filter({"A": 60, "B": 1})
    assert allowed("B") and not allowed("A")


def test_balanced_clients_share_every_step():
    counters = ServiceCounters(burst=16)
    for _ in range(20):
        allowed = counters.step_filter({"A": 8, "B": 8, "C": 8})
        assert all(allowed(c) for c in "ABC")
        for client in "ABC":
            counters.charge(client, 8)


def test_a_client_that_stops_having_work_is_forgotten():
    counters = ServiceCounters(burst=4)
    counters.step_filter({"A": 1, "B": 1})
    counters.charge("B", 1000)
    counters.step_filter({"A": 1})  # B's requests finished
    allowed = counters.step_filter({"A": 1, "B": 1})  # and B is back: no debt, no credit
    assert allowed("B") and not allowed("A")
    assert counters.spread == 4 + 1


def _flooded(burst: int) -> Scheduler:
    """Client A holds 15 of 16 slots with decodes; client B then sends one request."""
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256,
                             client_burst_tokens=burst)
    s = Scheduler(config, KVCacheManager(num_blocks=256, block_size=4))
    for i in range(15):
        s.add_request(Request(f"a{i}", [1, 2, 3], SamplingParams(max_tokens=200), client="A"))
    for _ in range(3):
        _step(s)
    s.add_request(Request("b", [4, 5, 6, 7], SamplingParams(max_tokens=20), client="B"))
    return s


def test_one_sequence_beside_a_flood_runs_in_steps_of_its_own():
    """B's 20 tokens come out of steps without A's 15 rows (its prompt's 4 tokens and 20
    decodes, with A's 15 rows on top, fit in B's starting credit of 40), where before every
    one of its steps was 16 rows wide; A waits those steps out and is not preempted."""
    s = _flooded(burst=40)
    widths = []
    while "b" in s.requests:
        out = _step(s)
        if "b" in out.num_scheduled_tokens:
            widths.append(len(out.num_scheduled_tokens))
        assert not out.preempted_req_ids
    assert len(widths) == 20 and set(widths) == {1}
    out = _step(s)
    assert len(out.num_scheduled_tokens) == 15 - 7, "A fills its share while B is recent"


def test_a_client_beside_a_recent_one_fills_its_share_of_each_step_in_turn():
    """After B's request, A's 15 rows run 8 a step (16 slots shared by two clients), those
    that ran longest ago first, so none waits two steps in a row; once B has had no work for
    RECENT_CLIENT_SECONDS, A runs at full width again."""
    s = _flooded(burst=40)
    while "b" in s.requests:
        _step(s)
    first, second = _step(s).num_scheduled_tokens, _step(s).num_scheduled_tokens
    assert len(first) == len(second) == 8
    assert set(first) | set(second) == {f"a{i}" for i in range(15)}
    s._recent_clients["B"] -= RECENT_CLIENT_SECONDS + 0.1
    assert len(_step(s).num_scheduled_tokens) == 15, "A runs at full width again"


def test_clients_get_equal_tokens_over_time():
    """With both clients always having work, each gets the same number of tokens give or
    take a burst and a step, whatever number of sequences each runs."""
    s = _flooded(burst=16)
    for i in range(3):  # B keeps three sequences running
        s.add_request(Request(f"b{i}", [4, 5], SamplingParams(max_tokens=200), client="B"))
    tokens: Counter[str] = Counter()
    for _ in range(120):
        out = _step(s)
        for req_id, n in out.num_scheduled_tokens.items():
            tokens["A" if req_id.startswith("a") else "B"] += n
    assert abs(tokens["A"] - tokens["B"]) <= 16 + 15, tokens
    assert tokens["A"] + tokens["B"] > 120 * 4, "steps are not starved"
