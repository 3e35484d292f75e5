"""The offline ``LLM`` API: prompt forms, output order and shape, chat, n, and bad input."""

from __future__ import annotations

import pytest
import torch

from tidal.core import LLM, RequestOutput, SamplingParams
from tidal.gpu.random_model import build_model_dir


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = build_model_dir(tmp_path_factory.mktemp("llm") / "llama", "llama")
    return LLM(str(path), max_num_seqs=4)


def test_outputs_come_back_in_input_order_for_strings_and_token_ids(llm):
    prompts = ["The quick brown fox", [5, 6, 7], "To be, or not", [30] * 40]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outputs) == len(prompts)
    for prompt, out in zip(prompts, outputs):
        assert isinstance(out, RequestOutput) and out.finished
        if isinstance(prompt, str):
            assert out.prompt == prompt
            assert out.prompt_token_ids == llm.tokenizer.encode(prompt)
        else:
            assert out.prompt_token_ids == prompt
        completion = out.outputs[0]
        assert len(completion.token_ids) == 6 and completion.finish_reason == "length"
        assert len(completion.logprobs) == 6
        assert all(len(entry) >= 2 for entry in completion.logprobs)
        assert completion.text == llm.tokenizer.decode(completion.token_ids,
                                                       skip_special_tokens=True)
    # the same prompt alone gives the same greedy tokens as in the batch
    alone = llm.generate(prompts[3], params, use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == outputs[3].outputs[0].token_ids


def test_detokenize_false_gives_the_same_ids_without_text(llm):
    prompts = ["The quick brown fox", [5, 6, 7]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    with_text = llm.generate(prompts, params, use_tqdm=False)
    ids_only = llm.generate(prompts, params.clone(detokenize=False), use_tqdm=False)
    for a, b in zip(with_text, ids_only):
        assert a.outputs[0].text and b.outputs[0].text == ""
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].logprobs == a.outputs[0].logprobs
        assert b.outputs[0].finish_reason == "length" and b.prompt == a.prompt
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.num_blocks


def test_n_gives_independent_choices_and_one_params_per_prompt(llm):
    out = llm.generate([[9, 10, 11]], SamplingParams(n=3, max_tokens=5, seed=1,
                                                     ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 5 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    per_prompt = [SamplingParams(max_tokens=2, ignore_eos=True),
                  SamplingParams(max_tokens=4, ignore_eos=True)]
    outs = llm.generate([[5], [6]], per_prompt, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 4]
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate([[5], [6], [7]], per_prompt, use_tqdm=False)


def test_an_unset_max_tokens_runs_to_the_end_of_the_context(llm):
    """``SamplingParams()`` sets no ``max_tokens``: the reply may take the room the context
    leaves, as over HTTP (``reply_budget``)."""
    prompt = [5, 6, 7]
    out = llm.generate([prompt], SamplingParams(ignore_eos=True, temperature=0.0),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == llm.engine.max_model_len - len(prompt)
    assert out.finish_reason == "length"


def test_seeds_at_the_top_of_64_bits_wrap_for_later_choices(llm):
    """Choices 1 and 2 of seed 2**64 - 1 draw from seeds 0 and 1, as torch has no larger."""
    params = SamplingParams(n=3, max_tokens=5, seed=2**64 - 1, ignore_eos=True)
    top = llm.generate([[9, 10, 11]], params, use_tqdm=False)[0].outputs
    low = llm.generate([[9, 10, 11]], params.clone(seed=0, n=2), use_tqdm=False)[0].outputs
    assert [c.token_ids for c in top[1:]] == [c.token_ids for c in low]
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.num_blocks


def test_a_generate_that_fails_midway_leaves_nothing_queued(llm):
    """The second prompt's params cannot fit the context: the first, already queued, is
    aborted, so the next call runs its own prompt alone."""
    engine = llm.engine
    with pytest.raises(ValueError, match="min_tokens"):
        llm.generate([[5, 6, 7], [8, 9]], [SamplingParams(max_tokens=200, ignore_eos=True),
                                           SamplingParams(max_tokens=None, min_tokens=10**4)],
                     use_tqdm=False)
    assert not engine.scheduler.waiting and not engine.scheduler.running
    steps = engine.profiler.num_steps
    out = llm.generate([[10, 11]], SamplingParams(max_tokens=1), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 1 and engine.profiler.num_steps - steps <= 2
    assert not engine.output_processor.parents
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("prompts,params,field", [
    ([[5.0, 6]], SamplingParams(max_tokens=2), "prompt token id 5.0 is not an integer"),
    ([[True, 6]], SamplingParams(max_tokens=2), "prompt token id True"),
    ([[5, 6]], SamplingParams(max_tokens=2, logit_bias={10**6: 1.0}), "logit_bias token id"),
    ([[5, 6]], ["not params"], "SamplingParams"),
])
def test_bad_prompts_and_params_are_value_errors(llm, prompts, params, field):
    with pytest.raises(ValueError, match=field):
        llm.generate(prompts, params, use_tqdm=False)
    assert not llm.engine.output_processor.parents


def test_a_stop_tokens_text_is_left_out_unless_asked_for(llm):
    """vLLM's rule: output ended by EOS or a stop id keeps the id but not its text, unless
    ``include_stop_str_in_output``."""
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                            skip_special_tokens=False)
    free = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    stop_id = free[3]
    first = free.index(stop_id)
    for include in (False, True):
        params = greedy.clone(stop_token_ids=[stop_id], include_stop_str_in_output=include)
        out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == free[:first + 1] and out.stop_reason == stop_id
        kept = out.token_ids if include else out.token_ids[:-1]
        assert out.text == llm.tokenizer.decode(kept, skip_special_tokens=False)


def test_chat_applies_the_template(llm):
    conversation = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hello there"}]
    out = llm.chat(conversation, SamplingParams(temperature=0.0, max_tokens=4),
                   use_tqdm=False)[0]
    expected = llm.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                 add_generation_prompt=True)
    assert out.prompt_token_ids == llm.tokenizer.encode(expected, add_special_tokens=False)
    assert llm.tokenizer.decode(out.prompt_token_ids).endswith("<|assistant|>\n")
    # OpenAI's list of text parts renders as their text, joined by newlines, as the server's
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    as_parts = llm.chat([conversation[0], {"role": "user", "content": parts}],
                        SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert as_parts.prompt_token_ids == llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
        [conversation[0], {"role": "user", "content": "Hello\nthere"}], tokenize=False,
        add_generation_prompt=True), add_special_tokens=False)
    with pytest.raises(ValueError, match="only text"):
        llm.chat([{"role": "user", "content": [{"type": "image_url"}]}], use_tqdm=False)


def test_bad_prompt_ids_and_context_overflow(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[10**7]], SamplingParams(max_tokens=2), use_tqdm=False)
    too_long = [5] * (llm.engine.max_model_len + 1)
    out = llm.generate([too_long, [5, 6]], SamplingParams(max_tokens=2, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "error"
    assert "context" in out[0].error
    assert out[1].outputs[0].finish_reason == "length"
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.num_blocks


def test_offline_cpu_budget_defaults_larger_than_the_servers(llm):
    from tidal.core.config import (
        DEFAULT_CPU_MAX_NUM_BATCHED_TOKENS,
        DEFAULT_CPU_OFFLINE_MAX_NUM_BATCHED_TOKENS,
    )

    assert llm.engine.config.max_num_batched_tokens == DEFAULT_CPU_OFFLINE_MAX_NUM_BATCHED_TOKENS
    assert DEFAULT_CPU_OFFLINE_MAX_NUM_BATCHED_TOKENS > DEFAULT_CPU_MAX_NUM_BATCHED_TOKENS
    chosen = LLM(llm.engine.config.model, max_num_seqs=2, max_num_batched_tokens=48)
    assert chosen.engine.config.max_num_batched_tokens == 48


def test_generate_leaves_the_callers_thread_modes_as_they_were(llm):
    """The step modes (inference mode, flushed denormals) are held for a whole run of steps,
    then given back."""
    assert not torch.is_inference_mode_enabled()
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert not torch.is_inference_mode_enabled()
    assert float("1e-310") * 3 > 0.0  # a denormal double: not flushed to zero here
    with llm.engine.step_modes():
        assert torch.is_inference_mode_enabled()
        with llm.engine.step_modes():  # nested: held already
            llm.engine.step()
        assert torch.is_inference_mode_enabled()
    assert not torch.is_inference_mode_enabled()

