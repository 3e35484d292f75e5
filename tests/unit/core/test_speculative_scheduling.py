"""Speculative decoding's host side, without a model: the n-gram proposer, the config, and the
scheduler's proposals, budget, stop checks inside an accepted run and roll-back of rejected
proposals (their KV slots, and no prefix-cache block holding one)."""

from __future__ import annotations

import random

import pytest

from tidal.core.config import EngineConfig
from tidal.core.kv_cache_manager import KVCacheManager
from tidal.core.ngram_proposer import propose_ngram
from tidal.core.request import Request, RequestStatus
from tidal.core.sampling_params import SamplingParams
from tidal.core.scheduler import Scheduler, SchedulerConfig
from tidal.core.scheduler_output import ModelRunnerOutput
from tidal.core.spec_policy import SpecPolicy, StepCost
from tidal.core.speculative_config import SpeculativeConfig, parse_speculative_config
from tidal.core.structured_output import StructuredOutputsParams
from tidal.core.suffix_proposer import SuffixProposer

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


def _ngram_reference(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup spelled out: every window, latest first, for each ``n``."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[-n:]:
                return tokens[start + n:start + n + k] if k > 0 else []
    return []


def test_the_proposer_agrees_with_every_window_spelled_out():
    rng = random.Random(0)
    for _ in range(400):
        tokens = [rng.randrange(rng.choice([2, 3, 40])) for _ in range(rng.randint(1, 50))]
        for k, n_min, n_max in ((4, 1, 3), (3, 2, 5), (2, 1, 1)):
            assert propose_ngram(tokens, k, n_min, n_max) == _ngram_reference(
                tokens, k, n_min, n_max), (tokens, k, n_min, n_max)


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
    suffix = parse_speculative_config({"method": "suffix", "suffix_decoding_min_token_prob": 0.3})
    assert suffix.num_speculative_tokens == suffix.suffix_decoding_max_tree_depth == 24
    assert suffix.suffix_decoding_min_token_prob == 0.3
    for bad in ({"method": "suffix", "suffix_decoding_min_token_prob": 2},
                {"method": "suffix", "suffix_decoding_max_spec_factor": 0},
                {"method": "suffix", "suffix_decoding_max_cached_requests": 0}):
        with pytest.raises(ValueError, match=next(k for k in bad if k != "method")):
            parse_speculative_config(bad)
    (tmp_path / "config.json").write_text("{}")
    # async scheduling keeps its default (on the GPU) and may be asked for beside speculation
    config = EngineConfig(str(tmp_path), device="cuda", speculative_config={"method": "ngram"})
    assert config.async_scheduling is True and config.speculative_config.method == "ngram"
    assert not EngineConfig(str(tmp_path), device="cpu",
                            speculative_config={"method": "ngram"}).async_scheduling
    assert EngineConfig(str(tmp_path), async_scheduling=True,
                        speculative_config={"method": "ngram"}).async_scheduling


# -- the scheduler --------------------------------------------------------------------------

def _scheduler(budget: int = 16, k: int = 4, block_size: int = 4,
               async_scheduling: bool = False) -> Scheduler:
    kv = KVCacheManager(32, block_size)
    return Scheduler(SchedulerConfig(4, budget, 64, async_scheduling=async_scheduling,
                                     speculative=SpeculativeConfig("ngram", k, 1, 2)), kv)


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


def test_constrained_requests_get_no_proposals_without_their_grammar():
    s = _scheduler()  # no structured-output manager: nothing checks the proposals
    request = Request("c", [1, 2, 1, 2, 1], SamplingParams(max_tokens=9))
    # as if the grammar had compiled: the scheduler only reads whether one is asked for
    request.sampling_params.structured_outputs = StructuredOutputsParams(regex="[0-9]+")
    assert s.speculator.propose(request, 16) == []
    plain = Request("p", [1, 2, 1, 2], SamplingParams(max_tokens=9))
    plain.append_output_token(1)
    assert s.speculator.propose(plain, 16) == [2, 1]
    request.append_output_token(1)
    assert s.speculator.propose(request, 16) == []


# -- suffix decoding ------------------------------------------------------------------------

def test_suffix_proposes_what_followed_the_longest_match_in_earlier_outputs():
    proposer = SuffixProposer(max_tree_depth=8)
    proposer.finished("a", [10, 11, 12, 13, 14, 15, 16, 17])
    # two tokens matched (5 differs from 11): at most one proposal per matched token
    assert proposer.propose("b", [1, 5, 12, 13], 8) == [14, 15]
    assert proposer.propose("c", [1, 11, 12, 13], 8) == [14, 15, 16]
    assert proposer.propose("c", [1, 11, 12, 13], 2) == [14, 15]  # k caps it
    assert proposer.propose("d", [1, 2, 3, 4], 8) == []


def test_suffix_follows_the_most_frequent_path_while_it_is_likely():
    outputs = [[1, 2, 3, 4, 5], [1, 2, 3, 9, 5], [1, 2, 3, 4, 5, 6]]
    for min_prob, want in ((0.3, [4, 5, 6]), (0.5, [4, 5]), (0.7, [])):
        proposer = SuffixProposer(min_token_prob=min_prob)
        for i, out in enumerate(outputs):
            proposer.finished(str(i), out)
        # 4 follows in two of three (2/3), then 5 in both (2/3), then 6 in one (1/3 in all)
        assert proposer.propose("r", [0, 1, 2, 3], 8) == want, min_prob
    # the longest match wins over more frequent shorter ones
    proposer = SuffixProposer(min_token_prob=0.3)
    for i, out in enumerate(outputs):
        proposer.finished(str(i), out)
    proposer.finished("long", [8, 7, 2, 3, 9, 9])
    assert proposer.propose("r", [8, 7, 2, 3], 8) == [9, 9]


def test_suffix_reads_the_requests_own_tokens_and_forgets_the_oldest_outputs():
    proposer = SuffixProposer(max_cached_requests=2)
    assert proposer.propose("own", [7, 8, 9, 1, 2, 7, 8], 8) == [9, 1]
    proposer.finished("own", [7, 8, 9, 1])
    proposer.finished("x", [20, 21, 22, 23])
    proposer.finished("y", [30, 31, 32, 33])
    assert proposer.num_cached == 2
    assert proposer.propose("r", [0, 8, 9], 8) == []  # "own"'s output was dropped
    assert proposer.propose("r", [0, 31, 32], 8) == [33]
    assert all(out_id != 0 for entries in proposer._index.values() for out_id, _ in entries)
    assert proposer._own.keys() == {"r"}


# -- when speculation pays ------------------------------------------------------------------

def test_step_cost_fits_rows_once_the_steps_vary():
    cost = StepCost()
    for _ in range(10):
        cost.observe(4, 0.01)
    assert cost.fit() is None  # one size of step: no slope to tell
    for rows in [1, 8, 32, 64, 2, 16] * 20:
        cost.observe(rows, 0.002 + 0.0005 * rows)
    a, b = cost.fit()
    assert abs(b - 0.0005) < 1e-4 and abs(a - 0.002) < 2e-3


def _policy(a: float, b: float, accepted: int, of: int) -> SpecPolicy:
    policy = SpecPolicy()
    for rows in [1, 4, 16, 64] * 10:
        policy.cost.observe(rows, a + b * rows)
    for _ in range(30):  # ``accepted`` of each ``of`` tried accepted
        policy.settled("r", of, accepted)
    return policy


def test_proposals_pay_on_a_small_batch_and_are_trimmed_as_it_fills():
    half = _policy(0.010, 0.0001, 1, 2)  # weights-bound steps; half the proposals accepted
    assert abs(half.alpha("r") - 0.5) < 0.05
    assert half.keep("r", 4, 1) == 4  # a row costs 1 % of a step: all pay
    assert half.keep("r", 4, 64) == 1  # a row is 39 % of a row's share: only the likeliest
    compute = _policy(0.001, 0.001, 1, 2)  # compute-bound steps
    assert compute.keep("r", 4, 32) == 0
    sure = _policy(0.001, 0.001, 4, 4)  # every proposal accepted
    assert sure.keep("r", 4, 32) == 4
    assert half.keep("new", 4, 64) == 1  # a new request starts from the overall rate
    assert SpecPolicy().keep("r", 4, 64) == 4  # nothing measured yet: every proposal runs


def test_the_scheduler_drops_proposals_that_would_not_pay_and_seeds_keep_theirs():
    s = _scheduler()
    s.speculator.modes.forced = True  # every step speculates: a seed then replays with them
    for rows in [1, 4, 16, 64] * 10:  # compute-bound steps: every row costs a millisecond
        s.speculator.observe_step(rows, 0.001 + 0.001 * rows)
    for _ in range(30):  # and proposals mostly rejected
        s.speculator.policy.settled("earlier", 4, 0)
    for req_id, seed in (("a", None), ("b", 5)):
        s.add_request(Request(req_id, [1, 2, 3, 1, 2, 3, 1], SamplingParams(
            max_tokens=20, seed=seed), eos_token_id=99))
    s.schedule()  # both prompts (b's first block a prefix hit)
    s.update_from_output(ModelRunnerOutput(["a", "b"], [[2], [2]]))
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {"b": [3, 1, 2]}
    assert out.num_scheduled_tokens == {"a": 1, "b": 4}
    assert s.speculator.stats.num_trimmed_tokens == 3
    s.update_from_output(ModelRunnerOutput(["a", "b"], [[3], [3, 1, 2, 3]]))
    s.speculator.modes.forced = None  # steps chosen by measurement: a seed gets none
    assert s.schedule().scheduled_spec_decode_tokens == {}


def test_with_async_scheduling_proposals_come_only_in_the_steps_that_speculate():
    s = _scheduler(async_scheduling=True)
    for req_id, params in (("greedy", {"temperature": 0.0, "seed": 5}), ("seeded", {"seed": 5}),
                           ("free", {})):
        s.add_request(Request(req_id, [1, 2, 3, 1, 2, 3, 1], SamplingParams(
            max_tokens=20, **params), eos_token_id=99))
    s.schedule()
    s.update_from_output(ModelRunnerOutput(["greedy", "seeded", "free"], [[2], [2], [2]]))
    s.speculator.active = False  # an async step: none
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {}
    s.update_from_output(ModelRunnerOutput(["greedy", "seeded", "free"], [[3], [3], [3]]))
    s.speculator.active = True  # a seeded sampling request never: its draws would change
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {"greedy": [1, 2, 3], "free": [1, 2, 3]}
    assert out.num_scheduled_tokens == {"greedy": 4, "seeded": 1, "free": 4}
