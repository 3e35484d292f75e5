"""The embedded default model: the shipped files load with HF transformers and with our engine,
our greedy tokens equal HF's, the chat template renders every role, and a chat reply ends on
EOS."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tidal import core
from tidal.core import DEFAULT_MODEL, LLM, SamplingParams

MAX_BYTES = 16 * 1024 * 1024
REQUIRED_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json"}
ROLE_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|system|>", "<|user|>",
               "<|assistant|>", "<|end|>"]
PROMPTS = ["ROMEO:\nBut soft, what light", "First Citizen:\nWe are accounted poor citizens,",
           "To be, or not to be"]
JOKE = [{"role": "user", "content": "Tell me a joke"}]


@pytest.fixture(scope="module")
def hf_model():
    return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=8)


def test_shipped_files_are_complete_flat_and_small():
    root = Path(DEFAULT_MODEL)
    assert root.is_absolute() and root.parent == Path(core.__file__).resolve().parent
    entries = list(root.iterdir())
    draft = root / "draft"  # its speculative-decoding draft, one folder down
    files = [p for p in entries if p != draft] + list(draft.iterdir())
    assert all(p.is_file() for p in files), \
        "package data ships only default_model/* and default_model/draft/*"
    for folder in (root, draft):
        assert REQUIRED_FILES <= {p.name for p in folder.iterdir()}
    assert sum(p.stat().st_size for p in files) <= MAX_BYTES


def test_loads_with_transformers_as_a_plain_llama(hf_model, tokenizer):
    assert type(hf_model).__name__ == "LlamaForCausalLM"
    assert hf_model.config.vocab_size == len(tokenizer)
    assert tokenizer.eos_token == "<|end|>" and tokenizer.bos_token == "<|begin_of_text|>"
    assert hf_model.config.eos_token_id == tokenizer.eos_token_id
    assert hf_model.generation_config.eos_token_id == tokenizer.eos_token_id
    ids = tokenizer.convert_tokens_to_ids(ROLE_TOKENS)
    assert len(set(ids)) == len(ROLE_TOKENS) and tokenizer.unk_token_id not in ids
    text = "O Romeo, Romeo! wherefore art thou Romeo?"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_chat_template_renders_every_role(tokenizer):
    conversation = [{"role": "system", "content": "You are Juliet."},
                    {"role": "user", "content": "Good morrow."},
                    {"role": "assistant", "content": "Good morrow, sir."},
                    {"role": "user", "content": "Tell me a joke"}]
    text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                         add_generation_prompt=True)
    assert text == ("<|begin_of_text|><|system|>\nYou are Juliet.<|end|>\n"
                    "<|user|>\nGood morrow.<|end|>\n<|assistant|>\nGood morrow, sir.<|end|>\n"
                    "<|user|>\nTell me a joke<|end|>\n<|assistant|>\n")
    ids = tokenizer.encode(text, add_special_tokens=False)
    role_ids = tokenizer.convert_tokens_to_ids(ROLE_TOKENS)
    assert [i for i in ids if i in role_ids] == tokenizer.convert_tokens_to_ids(
        ["<|begin_of_text|>", "<|system|>", "<|end|>", "<|user|>", "<|end|>", "<|assistant|>",
         "<|end|>", "<|user|>", "<|end|>", "<|assistant|>"])


def test_llm_serves_the_default_model_when_none_is_named(llm):
    assert llm.engine.config.model == DEFAULT_MODEL
    assert llm.tokenizer.eos_token_id in llm.engine.eos_token_ids


def test_our_greedy_tokens_equal_hf_greedy(llm, hf_model, tokenizer):
    chat = tokenizer.apply_chat_template(JOKE, tokenize=False, add_generation_prompt=True)
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in [*PROMPTS, chat]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()


def test_a_greedy_chat_reply_stops_at_eos(llm, tokenizer):
    out = llm.chat(JOKE, SamplingParams(temperature=0.0, max_tokens=200), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "stop"
    assert 0 < len(completion.token_ids) < 200
    assert completion.token_ids[-1] == tokenizer.eos_token_id
    assert completion.text.strip() and "<|" not in completion.text


def test_seeded_chat_replies_mostly_stop_at_eos(llm):
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=200, seed=seed)
              for seed in range(6)]
    outputs = llm.chat([JOKE] * len(params), params, use_tqdm=False)
    stopped = [o.outputs[0].finish_reason == "stop" for o in outputs]
    assert sum(stopped) >= 5, [o.outputs[0].text for o in outputs]
