"""The sampler: filters never let an excluded token through, seeds reproduce whatever the batch,
penalties / logit_bias / min_tokens equal a plain reference, greedy is the argmax of the
processed logits, and logprobs are those of the raw logits."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.device import KERNEL_TEST_DEVICE, on_test_device
from tidal.core import LLM, SamplingParams
from tidal.core.scheduler_output import GrammarBitmask, NewRequestData
from tidal.gpu.input_batch import CachedRequestState, InputBatch
from tidal.gpu.random_model import build_model_dir
from tidal.gpu.sampler import Sampler, apply_grammar_bitmask, process_logits, row_argmax
from tidal.gpu.sampling_metadata import build_sampling_metadata

VOCAB = 32
EOS = 3


def _batch(requests: list[tuple[SamplingParams, list[int], list[int]]], device: str = "cpu",
           ) -> tuple[InputBatch, list[CachedRequestState]]:
    """A persistent batch holding ``(params, prompt, outputs so far)`` per request (seeded ones
    with their generators on ``device``)."""
    batch = InputBatch(max_num_reqs=len(requests) + 1, max_model_len=256, max_blocks_per_req=16,
                       device=device)
    for i, (params, prompt, outputs) in enumerate(requests):
        batch.add(NewRequestData(
            req_id=f"r{i}", token_ids=prompt + outputs, num_prompt_tokens=len(prompt),
            sampling_params=params, block_ids=[], num_computed_tokens=0, seed=params.seed,
            eos_token_id=EOS))
    return batch, [batch.states[f"r{i}"] for i in range(len(requests))]


def _sample(requests, logits: torch.Tensor, in_flight=None):
    batch, states = _batch(requests)
    meta = build_sampling_metadata(batch, states, logits.shape[1], "cpu", in_flight=in_flight)
    return Sampler()(logits.clone(), meta)


# -- greedy and logprobs ----------------------------------------------------------------------

def test_greedy_is_argmax_alone_and_beside_sampled_rows():
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB)
    greedy = SamplingParams(temperature=0.0)
    out = _sample([(greedy, [1, 2], [])] * 6, logits)
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None
    hot = SamplingParams(temperature=2.0, top_k=5)
    mixed = [(greedy if i % 2 else hot, [1, 2], []) for i in range(6)]
    out = _sample(mixed, logits)
    ids = out.sampled_token_ids.tolist()
    assert [ids[i] for i in (1, 3, 5)] == logits.argmax(-1)[1::2].tolist()


def test_logprobs_are_raw_log_softmax_whatever_the_processing():
    torch.manual_seed(1)
    logits = torch.randn(4, VOCAB) * 3
    raw = torch.log_softmax(logits, -1)
    requests = [
        (SamplingParams(temperature=0.0, logprobs=3), [1], []),
        (SamplingParams(temperature=0.7, top_p=0.5, logprobs=5, seed=1), [1], [4]),
        (SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={7: 5.0},
                        logprobs=0), [7, 8], [9]),
        (SamplingParams(temperature=1.5, min_p=0.1, presence_penalty=1.0), [2], [2]),
    ]
    out = _sample(requests, logits)
    ids, values = out.logprob_token_ids, out.logprobs
    assert ids.shape == (4, 6) and values.shape == (4, 6)
    assert torch.equal(ids[:, 0], out.sampled_token_ids)
    assert torch.allclose(values, raw.gather(1, ids), atol=1e-6)
    assert torch.equal(ids[:, 1:], raw.topk(5, -1).indices)


def test_logprobs_with_a_plain_greedy_batch():
    logits = torch.randn(3, VOCAB)
    out = _sample([(SamplingParams(temperature=0.0, logprobs=2), [1], [])] * 3, logits)
    raw = torch.log_softmax(logits, -1)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert torch.allclose(out.logprobs[:, 1:], raw.topk(2, -1).values)


# -- filters never let an excluded token through ---------------------------------------------

# Distinct logits: token t has logit LOGITS[t]; probabilities, highest first, are about
# 0.40, 0.24, 0.15, 0.09, ... so the cut-offs below sit far from any boundary.
LOGITS = torch.tensor([-0.5 * t for t in range(VOCAB)])[torch.randperm(VOCAB,
                      generator=torch.Generator().manual_seed(3))]
RANKED = LOGITS.argsort(descending=True).tolist()


def _allowed_by(params: SamplingParams) -> set[int]:
    """The tokens a filter keeps, worked out from the probabilities at the row's temperature."""
    probs = torch.softmax(LOGITS / params.temperature, -1)
    keep = RANKED[:params.top_k] if params.top_k else list(RANKED)
    top = probs[RANKED[0]].item()
    keep = [t for t in keep if probs[t].item() >= params.min_p * top]
    kept_probs = torch.softmax(LOGITS[keep] / params.temperature, -1).tolist()
    nucleus, mass = [], 0.0
    for t, p in zip(keep, kept_probs):
        if mass >= params.top_p:
            break
        nucleus.append(t)
        mass += p
    return set(nucleus)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.5, top_k=4, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=3, top_p=0.9),  # the top-k binds, not the top-p
    SamplingParams(temperature=2.0, top_k=6, min_p=0.3),
    SamplingParams(temperature=1.0, top_k=5, top_p=0.8, min_p=0.05),
], ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}-minp{p.min_p}")
@pytest.mark.parametrize("beside", [SamplingParams(temperature=1.0), None],
                         ids=["beside-unfiltered-rows", "alone"])
def test_filters_never_sample_excluded_tokens(params, beside):
    torch.manual_seed(4)
    allowed = _allowed_by(params)
    assert 1 < len(allowed) < VOCAB
    # beside unfiltered rows, per-row parameters are exercised; alone, every row has the
    # same filters (with a top-k, top-p then ranks the top-k tokens only)
    others = [(beside, [1], [])] if beside is not None else []
    requests = ([(params, [1], [])] + others) * 1000
    ids = _sample(requests, LOGITS.repeat(len(requests), 1)).sampled_token_ids
    step = len(others) + 1
    drawn = ids[0::step].tolist()
    assert set(drawn) == allowed  # nothing excluded, and every kept token does come up
    probs = torch.softmax(LOGITS[sorted(allowed)] / params.temperature, -1)
    counts = torch.bincount(torch.tensor(drawn), minlength=VOCAB)[sorted(allowed)]
    assert torch.allclose(counts / len(drawn), probs, atol=0.05)
    if others:
        assert len(set(ids[1::step].tolist())) > len(allowed)  # unfiltered rows are not cut


@pytest.mark.parametrize("ks,top_p", [([1, 2, 3, 7, 0, 31], 1.0), ([1, 2, 3, 7, 31], 1.0),
                                      ([1, 2, 3, 7, 31], 0.99), ([1, 2, 3, 7, 0, 31], 0.99)])
def test_top_k_on_many_values_of_k_in_one_batch(ks, top_p):
    torch.manual_seed(5)
    requests = [(SamplingParams(temperature=1.0, top_k=k, top_p=top_p), [1], [])
                for k in ks] * 300
    ids = _sample(requests, LOGITS.repeat(len(requests), 1)).sampled_token_ids.view(300, -1)
    for column, k in enumerate(ks):
        drawn = set(ids[:, column].tolist())
        assert drawn <= set(RANKED[:k or VOCAB])
        assert len(drawn) >= min(k or VOCAB, 5)


# -- seeds -----------------------------------------------------------------------------------

def _seeded_run(position: int, others: list[SamplingParams], steps: int = 12) -> list[int]:
    """The tokens a seeded request draws over ``steps`` steps, sitting at ``position`` among
    ``others``; its logits depend on the step only, the others' logits are arbitrary."""
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    params = others[:position] + [seeded] + others[position:]
    batch, states = _batch([(p, [1, 2, 3], []) for p in params])
    noise = torch.Generator().manual_seed(position * 100 + len(others))
    tokens = []
    for step in range(steps):
        logits = torch.randn(len(params), VOCAB, generator=noise)
        logits[position] = torch.randn(VOCAB, generator=torch.Generator().manual_seed(step))
        meta = build_sampling_metadata(batch, states, VOCAB, "cpu")
        ids = Sampler()(logits, meta).sampled_token_ids.tolist()
        for state in states:
            state.num_pending += 1  # as the runner counts a launched step
        batch.append_tokens(states, [[t] for t in ids])
        tokens.append(ids[position])
    return tokens


def test_seeded_rows_reproduce_across_batch_compositions():
    alone = _seeded_run(0, [])
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.8, seed=99, top_k=4),
              SamplingParams(temperature=1.0, presence_penalty=1.0)]
    assert _seeded_run(2, others) == alone
    assert _seeded_run(4, others) == alone
    assert _seeded_run(1, others[:1]) == alone
    assert len(set(alone)) > 3  # it does sample


def test_a_different_seed_gives_different_tokens():
    def run(seed: int) -> list[int]:
        batch, states = _batch([(SamplingParams(temperature=1.0, seed=seed), [1], [])])
        logits = torch.zeros(1, VOCAB)
        out = []
        for _ in range(16):
            meta = build_sampling_metadata(batch, states, VOCAB, "cpu")
            out.append(Sampler()(logits.clone(), meta).sampled_token_ids.item())
        return out

    assert run(1) == run(1)
    assert run(1) != run(2)


# -- penalties, logit_bias, min_tokens against a plain reference ------------------------------

def _reference(logits: list[float], params: SamplingParams, prompt: list[int],
               outputs: list[int]) -> list[float]:
    """vLLM's logits processing written out token by token."""
    out = list(logits)
    for token, bias in (params.logit_bias or {}).items():
        out[token] += bias
    if len(outputs) < params.min_tokens:
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else {EOS})
        for token in stops:
            out[token] = -math.inf
    for token in range(len(out)):
        if token in prompt or token in outputs:
            r = params.repetition_penalty
            out[token] = out[token] / r if out[token] > 0 else out[token] * r
        count = outputs.count(token)
        out[token] -= params.frequency_penalty * count
        out[token] -= params.presence_penalty * (1.0 if count else 0.0)
    return out


PROCESSING_CASES = [
    (SamplingParams(repetition_penalty=1.7), [4, 5, 6, 4], [7, 4, 9]),
    (SamplingParams(repetition_penalty=0.6), [4, 5], [8]),
    (SamplingParams(presence_penalty=1.5, frequency_penalty=0.5), [4, 5, 6], [6, 6, 9, 10, 6]),
    (SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.25, repetition_penalty=1.2),
     [11, 12], [12, 13, 13]),
    (SamplingParams(logit_bias={1: 3.0, 30: -50.0, 999: 10.0}), [4], [5]),
    (SamplingParams(min_tokens=3, stop_token_ids=[20, 21]), [4], [5]),
    (SamplingParams(min_tokens=3, stop_token_ids=[20], ignore_eos=True), [4], [5]),
    (SamplingParams(min_tokens=2, stop_token_ids=[20]), [4], [5, 6]),  # reached: no mask
    (SamplingParams(min_tokens=5, logit_bias={EOS: 100.0}, frequency_penalty=2.0), [4], [5]),
    (SamplingParams(), [4], [5]),
    (SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.4), [1, 2, 3],
     [2]),
]


def _plain(params: SamplingParams) -> SamplingParams:
    """The reference's params, with bias keys outside the vocabulary dropped."""
    bias = {t: b for t, b in (params.logit_bias or {}).items() if t < VOCAB}
    return params.clone(logit_bias=bias or None)


@pytest.mark.parametrize("rows", [[0], [2], [4], [5], [6], [7], [8], [9], [10],
                                  list(range(len(PROCESSING_CASES))), [3, 9, 1, 5]])
def test_processing_equals_the_reference(rows):
    torch.manual_seed(6)
    requests = [PROCESSING_CASES[i] for i in rows]
    logits = torch.randn(len(requests), VOCAB) * 2
    batch, states = _batch(requests)
    meta = build_sampling_metadata(batch, states, VOCAB, "cpu")
    got = process_logits(logits.clone(), meta)
    for row, (params, prompt, outputs) in enumerate(requests):
        want = _reference(logits[row].tolist(), _plain(params), prompt, outputs)
        assert got[row].tolist() == pytest.approx(want, rel=1e-6, abs=1e-6)


def test_greedy_with_penalties_is_argmax_of_the_reference():
    torch.manual_seed(7)
    requests = [(params.clone(temperature=0.0), prompt, outputs)
                for params, prompt, outputs in PROCESSING_CASES]
    logits = torch.randn(len(requests), VOCAB)
    ids = _sample(requests, logits).sampled_token_ids.tolist()
    for row, (params, prompt, outputs) in enumerate(requests):
        want = torch.tensor(_reference(logits[row].tolist(), _plain(params), prompt, outputs))
        assert ids[row] == want.argmax().item()


def test_penalties_count_tokens_still_on_the_device():
    """A token sampled by the step in flight is penalised before it reaches the host."""
    params = SamplingParams(temperature=0.0, presence_penalty=1.0, frequency_penalty=0.5,
                            repetition_penalty=1.5)
    requests = [(SamplingParams(temperature=0.0), [1], []), (params, [4, 5], [6])]
    batch, states = _batch(requests)
    states[1].num_pending = 1
    in_flight = (torch.tensor([17, 6]), {"r0": 0, "r1": 1})
    logits = torch.randn(2, VOCAB)
    meta = build_sampling_metadata(batch, states, VOCAB, "cpu", in_flight=in_flight)
    got = process_logits(logits.clone(), meta)
    want = _reference(logits[1].tolist(), params, [4, 5], [6, 6])
    assert got[1].tolist() == pytest.approx(want, rel=1e-6, abs=1e-6)
    assert torch.equal(got[0], logits[0])


def test_min_tokens_uses_the_pending_count():
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[9])
    batch, states = _batch([(params, [4], [5])])
    logits = torch.zeros(1, VOCAB)
    meta = build_sampling_metadata(batch, states, VOCAB, "cpu")
    assert process_logits(logits.clone(), meta)[0, 9] == -math.inf
    states[0].num_pending = 1  # the second output is in flight: the mask is off
    meta = build_sampling_metadata(batch, states, VOCAB, "cpu")
    assert meta.plain_greedy


def test_plain_greedy_batch_builds_no_tensor():
    params = SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[9])
    batch, states = _batch([(params, [4], [5]), (SamplingParams(temperature=0.0), [4], [])])
    meta = build_sampling_metadata(batch, states, VOCAB, "cpu")
    assert meta.plain_greedy and meta.max_num_logprobs is None


def test_the_batch_counts_requests_that_need_metadata():
    """A batch with no such request skips its rows; one that joins, and leaves, is counted."""
    plain = SamplingParams(temperature=0.0)
    batch, states = _batch([(plain, [4], []), (plain, [5], [])])
    assert batch.num_needing_metadata == 0
    batch.add(NewRequestData(req_id="lp", token_ids=[6], num_prompt_tokens=1,
                             sampling_params=SamplingParams(temperature=0.0, logprobs=2),
                             block_ids=[], num_computed_tokens=0, seed=None))
    assert batch.num_needing_metadata == 1
    meta = build_sampling_metadata(batch, [*states, batch.states["lp"]], VOCAB, "cpu")
    assert meta.max_num_logprobs == 2
    batch.remove("lp", keep_generator=True)  # preempted: gone from the batch all the same
    assert batch.num_needing_metadata == 0
    assert build_sampling_metadata(batch, states, VOCAB, "cpu").max_num_logprobs is None


# -- end to end through LLM ------------------------------------------------------------------

KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # k+v, 2 layers, 2 kv heads, head dim 16, float32
ON_DEVICE = on_test_device(dtype="float32")  # the engine tests' engines


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(build_model_dir(tmp_path_factory.mktemp("sampler-llama"), "llama"))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(8)
    return [torch.randint(6, 400, (n,), generator=g).tolist() for n in (9, 40, 70, 25, 90, 55)]


@pytest.mark.slow
@pytest.mark.gpu
def test_seed_reproduces_through_llm_alone_batched_and_preempted(model_path):
    prompts = _prompts()
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24, ignore_eos=True)
              for i in range(len(prompts))]
    llm = LLM(model_path, **ON_DEVICE)
    alone = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
             for p, sp in zip(prompts, params)]
    extra = [SamplingParams(temperature=1.0, max_tokens=24), SamplingParams(temperature=0.0)]
    batched = llm.generate(prompts + prompts[:2], params + extra, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched[:len(prompts)]] == alone
    small = LLM(model_path, **on_test_device(kv_cache_memory=12 * 16 * KV_BYTES_PER_TOKEN,
                                              dtype="float32"))
    squeezed = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in squeezed] == alone
    assert len({t for ids in alone for t in ids}) > 30  # really sampled, not stuck


@pytest.mark.gpu
def test_min_tokens_and_logit_bias_through_llm(model_path):
    llm = LLM(model_path, **ON_DEVICE)
    eos = llm.tokenizer.eos_token_id
    params = SamplingParams(temperature=0.0, min_tokens=5, max_tokens=20,
                            logit_bias={eos: 100.0})
    outs = llm.generate(_prompts()[:3], params, use_tqdm=False)
    for out in outs:
        completion = out.outputs[0]
        assert len(completion.token_ids) == 6
        assert eos not in completion.token_ids[:5] and completion.token_ids[5] == eos
        assert completion.finish_reason == "stop"


def _run_engine(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Step the engine directly (a bounded number of steps) and collect each request's ids."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    finished: set[str] = set()
    for _ in range(200):
        for out in engine.step():
            tokens[out.request_id].extend(out.outputs[0].token_ids)
            if out.finished:
                finished.add(out.request_id)
        if len(finished) == len(prompts):
            break
    assert len(finished) == len(prompts)
    return [tokens[str(i)] for i in range(len(prompts))]


@pytest.mark.gpu
def test_penalties_give_the_same_tokens_with_async_scheduling(model_path):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                            repetition_penalty=1.5, presence_penalty=0.8,
                            frequency_penalty=0.4)
    prompts = _prompts()[:4]
    sync = _run_engine(LLM(model_path, async_scheduling=False, **ON_DEVICE), prompts, params)
    overlap = _run_engine(LLM(model_path, async_scheduling=True, **ON_DEVICE), prompts, params)
    plain = _run_engine(LLM(model_path, **ON_DEVICE), prompts, params.clone(
        repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0))
    assert overlap == sync
    assert plain != sync
    assert all(len(ids) == 20 for ids in sync)


def test_row_argmax_takes_the_first_of_tied_maxima():
    x = torch.randn(6, 8192)
    x[:, 4000] = x[:, 17] = x[:, 8000] = 1e9  # ties: the first index wins, as argmax's
    x[5, 3] = 2e9
    assert row_argmax(x).tolist() == [17] * 5 + [3]
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))


@pytest.mark.gpu
def test_sampling_waits_on_nothing_from_the_device():
    """Every processing step at once (penalties, logit_bias, min_tokens, temperature, min_p,
    top-k and top-p, seeded and unseeded draws, logprobs, a grammar bitmask) runs without one
    host-device synchronisation: on a GPU under CUDA's sync debug mode, which raises on any."""
    pytest.importorskip("xgrammar")
    device = KERNEL_TEST_DEVICE
    sampled = [SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, logprobs=2),
               SamplingParams(temperature=1.2, seed=11, top_p=0.5),
               SamplingParams(temperature=0.7, top_k=3)]
    requests = [*PROCESSING_CASES, *((p, [4, 5], [6]) for p in sampled)]
    batch, states = _batch(requests, device)
    meta = build_sampling_metadata(batch, states, VOCAB, device)
    logits = (torch.randn(len(requests), VOCAB) * 2).to(device)
    allowed = np.zeros((1, 1), dtype=np.int32)
    allowed[0, 0] = (1 << 7) | (1 << 9)  # the first row may say 7 or 9 alone
    grammar = GrammarBitmask(req_ids=["r0"], bitmask=allowed)
    row_ids = [f"r{i}" for i in range(len(requests))]
    debug = torch.cuda.get_sync_debug_mode() if device != "cpu" else None
    if device != "cpu":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        apply_grammar_bitmask(logits, grammar, row_ids)
        out = Sampler()(logits, meta)
    finally:
        if debug is not None:
            torch.cuda.set_sync_debug_mode(debug)
    ids = out.sampled_token_ids.tolist()
    assert ids[0] in (7, 9) and len(ids) == len(requests)
    assert out.logprobs is not None and out.logprobs.shape == (len(requests), 3)
