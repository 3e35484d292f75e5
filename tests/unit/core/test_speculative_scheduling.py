"""Speculative decoding's host side, without a model: the n-gram proposer, the config, and the
scheduler's proposals, budget, stop checks inside an accepted run and roll-back of rejected
proposals (their KV slots, and no prefix-cache block holding one)."""

from __future__ import annotations

import pytest

from tidal.core.config import EngineConfig
from tidal.core.kv_cache_manager import KVCacheManager
from tidal.core.ngram_proposer import SpeculativeConfig, parse_speculative_config, propose_ngram
from tidal.core.request import Request, RequestStatus
from tidal.core.sampling_params import SamplingParams
from tidal.core.scheduler import Scheduler, SchedulerConfig
from tidal.core.scheduler_output import ModelRunnerOutput
from tidal.core.structured_output import StructuredOutputsParams

# -- the proposer ---------------------------------------------------------------------------

def test_proposes_what_followed_the_latest_match_of_the_longest_suffix():
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3]
    # [1, 2, 3] (n=3) matches at 0 only: followed by 4, 9, 2
    assert propose_ngram(tokens, 3, 1, 3) == [4, 9, 2]
    # n capped at 2: [2, 3] matches at 5 (the latest) and 1: 5, 1, 2
    assert propose_ngram(tokens, 3, 1, 2) == [5, 1, 2]
    # k caps the proposals, and a match near the end proposes what there is
    assert propose_ngram(tokens, 1, 1, 3) == [4]
    assert propose_ngram([7, 8, 7], 4, 1, 2) == [8, 7]


def test_min_n_and_nothing_found():
    tokens = [1, 2, 3, 4, 5, 3]
    assert propose_ngram(tokens, 4, 1, 3) == [4, 5, 3]  # only the 1-gram [3] matches
    assert propose_ngram(tokens, 4, 2, 3) == []  # [5, 3] never came before
    assert propose_ngram([1, 2, 3], 4, 1, 3) == []
    assert propose_ngram([5], 4, 1, 3) == []
    assert propose_ngram(tokens, 0, 1, 3) == []


def test_config_takes_vllms_shape_and_refuses_the_rest(tmp_path):
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, '
                                   '"prompt_lookup_min": 1, "prompt_lookup_max": 4}')
    assert cfg == SpeculativeConfig("ngram", 3, 1, 4)
    assert parse_speculative_config(None) is None
    for bad in ({"method": "eagle"}, {"method": "ngram", "num_speculative_tokens": 0},
                {"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2},
                {"method": "ngram", "draft_model": "x"}, {"num_speculative_tokens": 2},
                "{not json"):
        with pytest.raises(ValueError):
            parse_speculative_config(bad)
    (tmp_path / "config.json").write_text("{}")
    config = EngineConfig(str(tmp_path), device="cuda", speculative_config={"method": "ngram"})
    assert config.async_scheduling is False and config.speculative_config.method == "ngram"
    with pytest.raises(ValueError, match="async scheduling"):
        EngineConfig(str(tmp_path), async_scheduling=True,
                     speculative_config={"method": "ngram"})


# -- the scheduler --------------------------------------------------------------------------

def _scheduler(budget: int = 16, k: int = 4, block_size: int = 4) -> Scheduler:
    kv = KVCacheManager(32, block_size)
    return Scheduler(SchedulerConfig(4, budget, 64, speculative=SpeculativeConfig(
        "ngram", k, 1, 2)), kv)


def _prefilled(s: Scheduler, req_id: str, prompt: list[int], first: int,
               **params: object) -> Request:
    request = Request(req_id, prompt, SamplingParams(**params), eos_token_id=99)
    s.add_request(request)
    while True:  # in chunks where the budget is small
        out = s.schedule()
        assert out.scheduled_spec_decode_tokens == {}  # prefilling: nothing proposed
        if request.num_computed_tokens == len(prompt):
            s.update_from_output(ModelRunnerOutput([req_id], [[first]]))
            return request
        s.update_from_output(ModelRunnerOutput([], []))


def test_proposals_are_scheduled_and_rejected_ones_rolled_back():
    s = _scheduler()
    r = _prefilled(s, "a", [1, 2, 3, 1, 2, 3, 1], 2, max_tokens=20)
    out = s.schedule()  # known: 1 2 3 1 2 3 1 2; [1, 2] last came at 3, followed by 3 1 2
    assert out.scheduled_spec_decode_tokens == {"a": [3, 1, 2]}
    assert out.num_scheduled_tokens == {"a": 4}
    assert r.num_computed_tokens == 11
    # the target accepted 3, then sampled 7 where the proposal was 1
    (update,) = s.update_from_output(ModelRunnerOutput(["a"], [[3, 7]]))
    assert update.new_token_ids == [3, 7] and not update.finished
    assert r.all_token_ids[-3:] == [2, 3, 7]
    assert r.num_computed_tokens == r.num_tokens - 1 == 9  # 7's KV is the next step's
    # only blocks of known tokens are ever registered for prefix hits
    assert s.kv.num_cached_blocks["a"] * 4 <= 8
    stats = s.speculator.stats
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 1)


def test_budget_caps_the_proposals_and_max_tokens_ends_inside_a_run():
    s = _scheduler(budget=3)
    r = _prefilled(s, "a", [5, 6, 5, 6, 5, 6, 5], 6, max_tokens=3)
    out = s.schedule()
    # max_tokens 3 with one out: two more tokens, so one proposal and the target's next
    assert out.scheduled_spec_decode_tokens == {"a": [5]}
    (update,) = s.update_from_output(ModelRunnerOutput(["a"], [[5, 6]]))
    assert update.finished and r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert r.output_token_ids == [6, 5, 6]
    s = _scheduler(budget=3)
    _prefilled(s, "b", [5, 6, 5, 6, 5, 6, 5], 6, max_tokens=30)
    assert s.schedule().scheduled_spec_decode_tokens == {"b": [5, 6]}  # budget 3: two


def test_a_stop_token_inside_an_accepted_run_drops_the_tokens_after_it():
    s = _scheduler()
    r = _prefilled(s, "a", [1, 2, 3, 4, 1, 2, 3, 4, 1], 2, max_tokens=30, stop_token_ids=[4],
                   logprobs=0)
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [3, 4, 1, 2]}
    logprobs = [{t: -0.5} for t in (3, 4, 1, 2, 9)]
    (update,) = s.update_from_output(ModelRunnerOutput(["a"], [[3, 4, 1, 2, 9]], [logprobs]))
    assert update.finished and r.stop_reason == 4
    assert update.new_token_ids == [3, 4] and update.new_logprobs == logprobs[:2]
    assert r.output_token_ids == [2, 3, 4]
    s = _scheduler()
    r = _prefilled(s, "e", [1, 2, 3, 99, 1, 2], 3, max_tokens=30)  # 99: EOS
    assert s.schedule().scheduled_spec_decode_tokens == {"e": [99, 1, 2, 3]}
    (update,) = s.update_from_output(ModelRunnerOutput(["e"], [[99, 1, 2, 3, 5]]))
    assert update.new_token_ids == [99] and r.finish_reason == "stop"


def test_constrained_requests_get_no_proposals():
    s = _scheduler()
    request = Request("c", [1, 2, 1, 2, 1], SamplingParams(max_tokens=9))
    # as if the grammar had compiled: the scheduler only reads whether one is asked for
    request.sampling_params.structured_outputs = StructuredOutputsParams(regex="[0-9]+")
    assert s.speculator.propose(request, 16) == []
    plain = Request("p", [1, 2, 1, 2], SamplingParams(max_tokens=9))
    plain.append_output_token(1)
    assert s.speculator.propose(plain, 16) == [2, 1]
    request.append_output_token(1)
    assert s.speculator.propose(request, 16) == []
