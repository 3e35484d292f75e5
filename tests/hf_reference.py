"""The reference our engine is held to: HF transformers' greedy tokens and logprobs on the same
weights, and the engine configured as the fidelity tests run it."""

from __future__ import annotations

import random

import pytest
import torch

from tests.device import TEST_DEVICE, on_test_device
from tidal.core import LLM, SamplingParams

NEW_TOKENS = 32


def reference_prompts(seed: int, shared_prefix: int = 0) -> list[list[int]]:
    """Eight prompts of 1 to 200 tokens (plus an optional prefix they all share)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(6, 400) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(6, 400) for _ in range(n)]
            for n in (1, 5, 17, 33, 64, 100, 150, 200)]


def hf_float_model(path: str, **load: object):
    """HF transformers' float32 model of ``path`` on the test device, set to run past EOS (as
    ``ignore_eos`` does), with a cache of its greedy runs for ``hf_greedy``; ``load`` goes to
    ``from_pretrained`` (e.g. ``attn_implementation="eager"``)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load).to(TEST_DEVICE)
    hf.generation_config.eos_token_id = None
    hf.reference_cache = {}
    return hf


def hf_greedy(hf, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    key = tuple(prompt)
    if key not in hf.reference_cache:
        hf.reference_cache[key] = run_hf(hf, prompt)
    return hf.reference_cache[key]


def run_hf(hf, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    out = hf.generate(torch.tensor([prompt], device=TEST_DEVICE), max_new_tokens=NEW_TOKENS,
                      do_sample=False, output_logits=True,
                      return_dict_in_generate=True, pad_token_id=0)
    logprobs = torch.log_softmax(torch.stack(out.logits)[:, 0].float(), dim=-1).cpu()
    return out.sequences[0, len(prompt):].tolist(), logprobs


def fidelity_llm(path: str, **kwargs) -> LLM:
    """Our engine on the test device, in float32 like the reference (on a GPU: Triton
    attention, CUDA graphs, async scheduling)."""
    return LLM(path, dtype="float32", **on_test_device(**kwargs))


def check_against_hf(hf, llm: LLM, prompts: list[list[int]], tol: float = 1e-4) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                            logprobs=3)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    for prompt, out in zip(prompts, outputs):
        ref_ids, ref_logprobs = hf_greedy(hf, prompt)
        completion = out.outputs[0]
        assert completion.token_ids == ref_ids, f"prompt of {len(prompt)} tokens diverged"
        assert completion.finish_reason == "length"
        for step, token_id in enumerate(ref_ids):
            top = torch.topk(ref_logprobs[step], 3)
            got = completion.logprobs[step]
            assert got[token_id] == pytest.approx(ref_logprobs[step, token_id].item(), abs=tol)
            for ref_id, ref_value in zip(top.indices.tolist(), top.values.tolist()):
                assert got[ref_id] == pytest.approx(ref_value, abs=tol)


@torch.no_grad()
def replace_hf_linears(hf, weight_for) -> None:
    """Give every decoder-layer linear of ``hf`` the weight ``weight_for(name, weight)`` returns
    (e.g. its quantized values dequantized): the float twin a quantized model is held to."""
    for name, module in hf.model.layers.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.copy_(weight_for(name, module.weight).to(module.weight.dtype))
