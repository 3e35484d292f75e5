"""Speculative decoding with async scheduling on: steps that speculate (the step in flight
processed first) between async steps without proposals, in a forced pattern, give a greedy
run the tokens and logprobs of a run without speculation (chunked prefill, prefix caching,
preemption, stop ids and strings, aborts, grammars); a seeded sampling request the tokens of
its seed without speculation."""

from __future__ import annotations

import itertools
import re

import pytest

from tests.device import on_test_device
from tests.unit.gpu.test_spec_decode import (  # noqa: F401 - a fixture
    SPEC,
    _assert_same,
    _completions,
    _prompts,
    echo_model,
)
from tests.unit.gpu.test_spec_grammar import WORDS
from tidal.core import LLM, SamplingParams
from tidal.core.outputs import RequestOutput
from tidal.core.structured_output import StructuredOutputsParams

# which steps speculate: runs of each mode, and single steps of each between the other's
PATTERN = [True, True, True, False, False, True, False, False, False, True, False]


def alternating(llm: LLM) -> LLM:
    """``llm`` speculating in ``PATTERN``'s steps, every proposal run."""
    engine = llm.engine
    assert engine.config.async_scheduling and engine.spec_modes is not None
    engine.scheduler.speculator.policy.keep = lambda _req_id, n, _rows: n
    steps = itertools.cycle(PATTERN)
    engine.spec_modes.choose = lambda _running: next(steps)
    return llm


def _args(**extra: object) -> dict[str, object]:
    return on_test_device(dtype="float32", max_num_seqs=4, async_scheduling=True,
                          max_num_batched_tokens=24, **extra)


@pytest.fixture(scope="module")
def plain(echo_model) -> LLM:  # noqa: F811
    """Async scheduling without speculation: the reference."""
    return LLM(echo_model, **_args())


@pytest.fixture(scope="module")
def spec(echo_model) -> LLM:  # noqa: F811
    return alternating(LLM(echo_model, speculative_config=SPEC, **_args()))


@pytest.mark.gpu
def test_greedy_between_async_steps_gives_the_tokens_and_logprobs_without(
        echo_model, plain, spec):  # noqa: F811
    args = _args()
    params = [SamplingParams(temperature=0.0, max_tokens=m, logprobs=2, ignore_eos=True)
              for m in (37, 30, 41, 26)]
    params[2] = params[2].clone(frequency_penalty=0.1)
    want = _completions(plain.generate(_prompts(), params, use_tqdm=False))
    _assert_same(_completions(spec.generate(_prompts(), params, use_tqdm=False)), want)
    stats = spec.engine.stats()
    assert stats.spec_decode_num_accepted_tokens >= 5
    # preempted for KV blocks and recomputed
    squeezed = alternating(LLM(echo_model, speculative_config=SPEC,
                               **{**args, "kv_cache_memory": 12 * 16 * 512}))
    _assert_same(_completions(squeezed.generate(_prompts(), params, use_tqdm=False)), want)
    assert squeezed.engine.stats().num_preemptions > 0
    # stop token ids inside the cycles, stop strings from the text; prefix cache hits
    outs = plain.generate(_prompts(), params, use_tqdm=False)
    stop_params = [p.clone(stop_token_ids=[o.outputs[0].token_ids[-3]]) if i % 2 else
                   p.clone(stop=[o.outputs[0].text[-12:-8]])
                   for i, (p, o) in enumerate(zip(params, outs))]
    want = plain.generate(_prompts(), stop_params, use_tqdm=False)
    got = spec.generate(_prompts(), stop_params, use_tqdm=False)
    assert spec.engine.stats().prefix_cache_hits > 0
    assert [(o.outputs[0].text, o.outputs[0].finish_reason) for o in got] == \
        [(o.outputs[0].text, o.outputs[0].finish_reason) for o in want]
    # a stop string's step keeps its tokens past it in token_ids: compare the stop ids' only
    _assert_same(_completions(got)[1::2], _completions(want)[1::2])


def _run_aborting(llm: LLM, params: SamplingParams, abort_after: int) -> list[list[int]]:
    """Every prompt's tokens, the first request aborted after ``abort_after`` steps."""
    ids = [llm._add(prompt, params) for prompt in _prompts()]
    results: dict[str, RequestOutput] = {}
    with llm.engine.step_modes():
        for step in itertools.count():
            if step == abort_after:
                llm.engine.abort_requests([ids[0]])
            if not llm.engine.has_unfinished_requests():
                break
            for delta in llm.engine.step():
                if delta.request_id in results:
                    results[delta.request_id].merge(delta)
                else:
                    results[delta.request_id] = delta
    return [results[i].outputs[0].token_ids for i in ids]


@pytest.mark.gpu
def test_an_abort_between_modes_leaves_the_others_tokens(plain, spec):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = _run_aborting(plain, params, 10**9)
    for abort_after in (6, 9):  # somewhere in the pattern, twice
        got = _run_aborting(spec, params, abort_after)
        assert len(got[0]) < 30 and got[0] == want[0][:len(got[0])]
        assert got[1:] == want[1:]


@pytest.mark.gpu
def test_a_seed_gives_its_tokens_without_speculation(plain, spec):
    seeded = SamplingParams(temperature=0.8, top_k=20, seed=3, n=2, max_tokens=24,
                            ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    params = [greedy, seeded, greedy]
    prompts = [_prompts()[i] for i in (2, 0, 3)]  # the first repeats itself
    want = plain.generate(prompts, params, use_tqdm=False)
    drafted = spec.engine.stats().spec_decode_num_draft_tokens
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == \
        [[c.token_ids for c in o.outputs] for o in want]
    assert spec.engine.stats().spec_decode_num_draft_tokens > drafted  # the greedy rows'


@pytest.mark.gpu
def test_constrained_greedy_between_async_steps_keeps_its_tokens(plain, spec):
    free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    words = SamplingParams(temperature=0.0, max_tokens=130,
                           structured_outputs=StructuredOutputsParams(regex=WORDS))
    prompts, params = _prompts()[1:] * 2, [free] * 3 + [words] * 3
    want = plain.generate(prompts, params, use_tqdm=False)
    accepted = spec.engine.stats().spec_decode_num_accepted_tokens
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for out in got[3:]:
        assert re.fullmatch(WORDS, out.outputs[0].text), out.outputs[0].text
    assert spec.engine.stats().spec_decode_num_accepted_tokens > accepted
