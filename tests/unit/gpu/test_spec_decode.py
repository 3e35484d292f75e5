"""Speculative decoding's verification: rejection sampling keeps the target's distribution
(with top-k / top-p too), greedy keeps the longest agreeing prefix, and through the engine a
greedy run with proposals gives the tokens and logprobs of one without (chunked prefill,
prefix caching, stops inside an accepted run), with the acceptance counters moving."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.device import TEST_DEVICE, on_test_device
from tidal.app.metrics import ServerMetrics
from tidal.core import LLM, SamplingParams
from tidal.core.scheduler_output import NewRequestData
from tidal.gpu.input_batch import InputBatch
from tidal.gpu.random_model import build_model_dir
from tidal.gpu.sampler import process_logits
from tidal.gpu.sampling_metadata import RandomRows, SamplingMetadata, build_sampling_metadata
from tidal.gpu.spec_step import SpecRows, group_by_request, spec_rows, write_drafts
from tidal.gpu.spec_verify import verify

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}
TARGET = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])


# -- the verifier ---------------------------------------------------------------------------

def test_greedy_keeps_the_agreeing_prefix_and_the_targets_next_token():
    logits = torch.full((5, 8), -1.0)
    for row, best in enumerate([3, 5, 1, 6, 2]):
        logits[row, best] = 1.0
    # request 0: three rows, drafts 3 (right) then 4 (wrong); request 1: two rows, 6 right
    drafts = torch.tensor([3, 4, -1, 6, -1])
    out = verify(logits, SamplingMetadata(5, None), drafts)
    assert out.accepted.tolist() == [True, False, False, True, False]
    assert out.sampled_token_ids.tolist() == [3, 5, 1, 6, 2]
    rows = SpecRows([3, 2], drafts, [])
    tokens, _ = group_by_request(rows, out.sampled_token_ids.tolist(), out.accepted.tolist(),
                                 None)
    assert tokens == [[3, 5], [6, 2]]


def _reference_probs(temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The target distribution, computed plainly: temperature, the top k, then the smallest
    set of the most likely whose mass reaches top_p."""
    probs = torch.softmax(TARGET / temperature, -1).numpy().astype(np.float64)
    order = np.argsort(-probs)
    keep = np.zeros_like(probs, dtype=bool)
    keep[order[:top_k or len(probs)]] = True
    kept = np.where(keep, probs, 0.0)
    kept /= kept.sum()
    mass = 0.0
    for i in np.argsort(-kept):
        if mass >= top_p:
            keep[i] = False
        mass += kept[i]
    final = np.where(keep, probs, 0.0)
    return final / final.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 4, 0.8)])
def test_rejection_sampling_keeps_the_target_distribution(temperature, top_k, top_p):
    n = 40_000
    torch.manual_seed(1)
    meta = SamplingMetadata(n, None, RandomRows(
        rows=torch.arange(n), temperature=torch.full((n,), temperature),
        top_k=torch.full((n,), top_k) if top_k else None,
        top_p=torch.full((n,), top_p) if top_p < 1.0 else None, min_p=None,
        max_top_k=top_k, all_top_k=bool(top_k), all_rows=True))
    # half the rows propose token 1 (likely), a quarter token 4 (cut by top-k), the rest none
    drafts = torch.tensor([1] * (n // 2) + [4] * (n // 4) + [-1] * (n // 4))
    out = verify(TARGET.repeat(n, 1), meta, drafts)
    expected = _reference_probs(temperature, top_k, top_p)
    tokens = out.sampled_token_ids.numpy()
    accepted = out.accepted.numpy()
    for part in (slice(0, n // 2), slice(n // 2, 3 * n // 4), slice(3 * n // 4, n)):
        freq = np.bincount(tokens[part], minlength=len(expected)) / len(tokens[part])
        assert 0.5 * np.abs(freq - expected).sum() < 0.015, (freq, expected)
    assert abs(accepted[: n // 2].mean() - expected[1]) < 0.015
    assert not accepted[n // 2:].any() if expected[4] == 0 else True


def test_seeded_rows_replay():
    def run() -> tuple[list[int], list[bool]]:
        generator = torch.Generator().manual_seed(7)  # one request's three rows
        meta = SamplingMetadata(3, None, RandomRows(
            rows=torch.arange(3), temperature=torch.ones(3), top_k=None, top_p=None,
            min_p=None, generators={i: generator for i in range(3)}, all_rows=True))
        out = verify(TARGET.repeat(3, 1), meta, torch.tensor([1, 0, -1]))
        return out.sampled_token_ids.tolist(), out.accepted.tolist()

    assert run() == run()


def test_each_rows_penalties_and_min_tokens_count_the_proposals_before_it():
    batch = InputBatch(max_num_reqs=2, max_model_len=16, max_blocks_per_req=1, device="cpu")
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0, min_tokens=3)
    batch.add(NewRequestData(req_id="r", token_ids=[1, 2, 3], num_prompt_tokens=2,
                             sampling_params=params, block_ids=[], num_computed_tokens=2,
                             seed=None, eos_token_id=7))
    states = [batch.states["r"]]
    spec = {"r": [4, 4]}
    write_drafts(batch, states, spec)
    _, rows = spec_rows(states, np.array([2]), spec, "cpu")
    meta = build_sampling_metadata(batch, rows.row_states, 8, "cpu")
    logits = process_logits(torch.zeros(3, 8), meta)
    want = torch.zeros(3, 8)
    want[:, 3] = -1.0  # the output token so far
    want[1, 4], want[2, 4] = -1.0, -2.0  # the proposals before each row
    want[:2, 7] = float("-inf")  # EOS masked while below min_tokens: 1 and 2 outputs
    assert torch.equal(logits, want)


# -- through the engine ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def echo_model(tmp_path_factory) -> str:
    """A random Llama whose attention and MLP outputs are scaled down: its next token depends
    mostly on the current one, so its greedy output falls into cycles that prompt lookup
    predicts, while attention still moves every logit."""
    return _echo_model(tmp_path_factory)


@pytest.fixture(scope="module")
def stack_echo_model(tmp_path_factory) -> str:
    """``echo_model`` with heads of 32, a width the CPU's decode attention takes, so that its
    one-call decode step runs it."""
    return _echo_model(tmp_path_factory, num_attention_heads=2, num_key_value_heads=1)


def _echo_model(tmp_path_factory, **overrides: int) -> str:
    path = build_model_dir(tmp_path_factory.mktemp("spec") / "llama", "llama", **overrides)
    weights = load_file(path / "model.safetensors")
    for name in weights:
        if "o_proj" in name or "down_proj" in name:
            weights[name] = weights[name] * 0.01
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


def speculating(llm: LLM) -> LLM:
    """``llm`` speculating in every step with every proposal run: the measured choices
    (``core/spec_mode.py``, ``core/spec_policy.py``) would run some steps without proposals
    and trim some proposals by this host's step times, and these tests count the proposals."""
    llm.engine.scheduler.speculator.policy.keep = lambda _req_id, n, _rows: n
    llm.engine.spec_modes.forced = True
    return llm


def _prompts() -> list[list[int]]:
    shared = [40 + i % 7 for i in range(36)]  # a prefix the second run finds cached
    return [shared + [5, 6, 7, 5, 6, 7, 5], shared + list(range(60, 75)),
            [9, 10, 11, 12] * 6, list(range(100, 113))]


def _completions(outs) -> list[tuple[list[int], str, list[dict]]]:
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].logprobs)
            for o in outs]


def _assert_same(got, want) -> None:
    for (ids, reason, logprobs), (ids0, reason0, logprobs0) in zip(got, want, strict=True):
        assert (ids, reason) == (ids0, reason0)
        for entry, entry0 in zip(logprobs, logprobs0, strict=True):
            assert entry.keys() == entry0.keys()
            assert max(abs(entry[t] - entry0[t]) for t in entry) < 1e-4


class _StackSpy:
    """The runner's one-call decode step, counting each step's rows and requests."""

    def __init__(self, stack, runner) -> None:
        self.stack, self.runner, self.steps = stack, runner, []

    def forward(self, *args):
        self.steps.append((len(args[0]), len(self.runner.batch.states)))
        return self.stack.forward(*args)


def _spy_on_the_stack(llm: LLM) -> list[tuple[int, int]]:
    runner = llm.engine.executor.runner
    if runner.cpu is None or runner.cpu.stack is None:
        return []
    runner.cpu.stack = spy = _StackSpy(runner.cpu.stack, runner)
    return spy.steps


@pytest.mark.gpu
def test_greedy_with_proposals_gives_the_tokens_and_logprobs_without(stack_echo_model):
    echo_model = stack_echo_model
    args = on_test_device(dtype="float32", max_num_seqs=4, max_num_batched_tokens=24)
    plain = LLM(echo_model, **args)
    spec = speculating(LLM(echo_model, speculative_config=SPEC, **args))
    params = [SamplingParams(temperature=0.0, max_tokens=m, logprobs=2, ignore_eos=True)
              for m in (37, 30, 41, 26)]
    # penalties count the proposals before a row as output tokens
    params[2] = params[2].clone(frequency_penalty=0.1)
    want = _completions(plain.generate(_prompts(), params, use_tqdm=False))
    stack_rows = _spy_on_the_stack(spec)
    got = _completions(spec.generate(_prompts(), params, use_tqdm=False))
    _assert_same(got, want)
    if TEST_DEVICE == "cpu":  # verifying steps ran as decode steps of k + 1 rows a request
        assert any(rows > reqs for rows, reqs in stack_rows), stack_rows
    stats = spec.engine.stats()
    assert stats.spec_decode_num_accepted_tokens >= 10
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens
    metrics = ServerMetrics(lambda: stats).render().decode()
    assert (f"tidal:spec_decode_num_accepted_tokens_total "
            f"{float(stats.spec_decode_num_accepted_tokens)}") in metrics
    # per position: the first position of a run accepted most, and they add up
    per_pos = stats.spec_decode_accepted_per_pos
    assert sum(per_pos) == stats.spec_decode_num_accepted_tokens
    assert list(per_pos) == sorted(per_pos, reverse=True) and 0 < stats.spec_decode_num_drafts
    assert (f'tidal:spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} '
            f"{float(per_pos[0])}") in metrics
    # preempted for KV blocks (12 of 16 tokens; 512 bytes a token) and recomputed
    squeezed = speculating(LLM(echo_model, speculative_config=SPEC, **{
        **args, "kv_cache_memory": 12 * 16 * 512}))
    _assert_same(_completions(squeezed.generate(_prompts(), params, use_tqdm=False)), want)
    assert squeezed.engine.stats().num_preemptions > 0
    # a stop token id from inside each output's cycle, and max_tokens anywhere in a run:
    # both end the run where they land; the prefix cache now holds the prompts' blocks
    stop_params = [p.clone(stop_token_ids=[ids[-3]], max_tokens=p.max_tokens - 1 + i % 2)
                   for i, (p, (ids, _, _)) in enumerate(zip(params, want))]
    want = _completions(plain.generate(_prompts(), stop_params, use_tqdm=False))
    got = _completions(spec.generate(_prompts(), stop_params, use_tqdm=False))
    assert spec.engine.stats().prefix_cache_hits > 0
    assert any(reason == "stop" for _, reason, _ in got)
    _assert_same(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_sampling_with_proposals_replays_its_seed_and_keeps_n(echo_model, async_scheduling):
    spec = LLM(echo_model, speculative_config=SPEC, **on_test_device(
        dtype="float32", max_num_seqs=4, async_scheduling=async_scheduling))
    params = SamplingParams(temperature=0.8, top_k=20, seed=3, n=2, max_tokens=24,
                            ignore_eos=True)
    first = spec.generate(_prompts()[2:], params, use_tqdm=False)
    again = spec.generate(_prompts()[2:], params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in first] == \
        [[c.token_ids for c in o.outputs] for o in again]
    assert all(len(c.token_ids) == 24 for o in first for c in o.outputs)


@pytest.mark.gpu
def test_suffix_decoding_keeps_the_tokens_and_learns_from_earlier_outputs(echo_model):
    args = on_test_device(dtype="float32", max_num_seqs=4, max_num_batched_tokens=24)
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=2, ignore_eos=True)
    want = _completions(LLM(echo_model, **args).generate(_prompts(), params, use_tqdm=False))
    spec = speculating(LLM(echo_model, speculative_config={"method": "suffix",
                                                           "num_speculative_tokens": 6}, **args))
    _assert_same(_completions(spec.generate(_prompts(), params, use_tqdm=False)), want)
    first = spec.engine.stats().spec_decode_num_accepted_tokens
    assert first > 0  # the requests' own cycles
    # again: the earlier outputs, now cached, propose longer runs
    _assert_same(_completions(spec.generate(_prompts(), params, use_tqdm=False)), want)
    assert spec.engine.stats().spec_decode_num_accepted_tokens - first > first
