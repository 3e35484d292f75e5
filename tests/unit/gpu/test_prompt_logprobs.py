"""Prompt logprobs (``SamplingParams(prompt_logprobs=k)``) equal HF transformers' log_softmax
of its logits on the same weights, whatever the chunking, prefix caching or batch."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.device import TEST_DEVICE
from tests.hf_reference import fidelity_llm
from tidal.core import LLM, SamplingParams
from tidal.core.outputs import Logprob
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.random_model import build_model_dir

pytestmark = pytest.mark.gpu

TOP = 3
PROMPTS = [[5 + (7 * i) % 300 for i in range(40)], [11, 12, 13], [200 + i for i in range(23)]]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[str, AutoModelForCausalLM]:
    path = build_model_dir(tmp_path_factory.mktemp("plp"), "llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(TEST_DEVICE)
    return str(path), hf


@pytest.fixture(scope="module")
def chunked(model) -> LLM:
    """Prefill in chunks of 16 tokens, prefix caching on (the default)."""
    return fidelity_llm(model[0], max_num_batched_tokens=16, max_num_seqs=4)


@torch.no_grad()
def hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row j scores prompt token j + 1."""
    logits = hf(torch.tensor([prompt], device=TEST_DEVICE)).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).cpu()


def check(hf, prompt: list[int], got: list[dict[int, Logprob] | None], k: int = TOP) -> None:
    ref = hf_prompt_logprobs(hf, prompt)
    assert len(got) == len(prompt) and got[0] is None
    for j, entry in enumerate(got[1:]):
        token = prompt[j + 1]
        assert entry is not None and token in entry
        assert entry[token].logprob == pytest.approx(ref[j, token].item(), abs=1e-4)
        own = ref[j, token]  # its rank: 1 + the tokens likelier than it (near-ties either way)
        assert int((ref[j] > own + 1e-4).sum()) < entry[token].rank \
            <= int((ref[j] > own - 1e-4).sum()) + 1
        top = torch.topk(ref[j], k)
        for place, (ref_id, ref_value) in enumerate(zip(top.indices.tolist(),
                                                        top.values.tolist()), start=1):
            assert entry[ref_id].logprob == pytest.approx(ref_value, abs=1e-4)
            if ref_id != token:
                assert entry[ref_id].rank == place
        assert set(entry) <= set(top.indices.tolist()) | {token}


def test_chunked_prefill_and_a_batch_beside_a_request_without(model, chunked):
    path, hf = model
    params = [SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP),
              SamplingParams(temperature=0.0, max_tokens=2),
              SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)]
    outs = chunked.generate(PROMPTS, params, use_tqdm=False)
    check(hf, PROMPTS[0], outs[0].prompt_logprobs)
    assert outs[1].prompt_logprobs is None
    check(hf, PROMPTS[2], outs[2].prompt_logprobs, k=0)
    assert all(len(o.outputs[0].token_ids) == 2 for o in outs)
    decoded = outs[0].prompt_logprobs[1][PROMPTS[0][1]].decoded_token
    assert decoded == chunked.tokenizer.decode([PROMPTS[0][1]], skip_special_tokens=False)


def test_a_prefix_cache_hit_is_scored_in_full(model, chunked):
    path, hf = model
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=TOP)
    plain = SamplingParams(temperature=0.0, max_tokens=1)
    chunked.generate([PROMPTS[0]], plain, use_tqdm=False)  # its blocks now in the cache
    for _ in range(2):
        out = chunked.generate([PROMPTS[0]], params, use_tqdm=False)[0]
        check(hf, PROMPTS[0], out.prompt_logprobs)
    again = chunked.generate([PROMPTS[0]], plain, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0  # the cache itself still serves the others


def test_max_tokens_zero_scores_the_prompt_alone(model, chunked):
    path, hf = model
    params = SamplingParams(max_tokens=0, prompt_logprobs=1, n=2)
    out = chunked.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    check(hf, PROMPTS[0], out.prompt_logprobs, k=1)
    assert [c.token_ids for c in out.outputs] == [[], []]
    assert [c.finish_reason for c in out.outputs] == ["length", "length"]
    assert [c.text for c in out.outputs] == ["", ""]
    single = chunked.generate([[7]], params, use_tqdm=False)[0]  # nothing to score
    assert single.prompt_logprobs == [None] and single.outputs[0].token_ids == []


def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def test_async_scheduling_under_preemption(model):
    """A preempted request computes its prompt again; its scores are kept once."""
    path, hf = model
    blocks = 6 * 16 * ModelConfig.from_dir(path).kv_bytes_per_token(4)
    llm = fidelity_llm(path, async_scheduling=True, max_num_batched_tokens=16,
                       kv_cache_memory=blocks)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                            prompt_logprobs=TOP)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0
    for prompt, out in zip(PROMPTS, outs):
        check(hf, prompt, out.prompt_logprobs)


def test_one_token_chunks_beside_decodes(tmp_path_factory):
    """A budget of two tokens: a prompt's one-token chunks beside another request's decodes,
    steps the runner prepares as decode steps (on the CPU, run by the one-call decode step,
    which takes this Qwen2 shape)."""
    path = str(build_model_dir(tmp_path_factory.mktemp("plp_qwen2"), "qwen2", hidden_size=128))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(TEST_DEVICE)
    llm = fidelity_llm(path, max_num_batched_tokens=2, max_num_seqs=2)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                            prompt_logprobs=TOP)
    outs = llm.generate([PROMPTS[1], PROMPTS[2][:9]], params, use_tqdm=False)
    check(hf, PROMPTS[1], outs[0].prompt_logprobs)
    check(hf, PROMPTS[2][:9], outs[1].prompt_logprobs)
