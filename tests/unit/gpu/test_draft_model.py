"""Speculative decoding with a draft model (gpu/draft_runner.py): greedy with the draft gives
the target's greedy tokens (a batch, chunked prefill, prefix hits, preemption), with a draft
that agrees often (the target's first layer alone) and one that rarely does (random); at
temperature 1 the tokens keep the target's distribution (against HF transformers'); the
embedded model's shipped draft; a draft with another vocabulary is refused."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tests.device import on_test_device
from tests.unit.gpu.test_spec_decode import _assert_same, _completions, _prompts, speculating
from tidal.core import LLM, SamplingParams
from tidal.core.speculative_config import parse_speculative_config, resolve_draft_model
from tidal.gpu.random_model import build_model_dir

ARGS = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=24)


def _first_layer_draft(target: Path, out: Path) -> str:
    """A draft of ``target``'s embeddings, first layer and head: it shares the vocabulary,
    and on a model whose layers barely move the residual it mostly agrees."""
    shutil.copytree(target, out)
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(config))
    weights = load_file(target / "model.safetensors")
    save_file({k: v for k, v in weights.items() if ".layers." not in k or ".layers.0." in k},
              out / "model.safetensors", metadata={"format": "pt"})
    return str(out)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, str]:
    """An echo target (as in test_spec_decode.py: attention and MLP outputs scaled down) and
    its drafts: itself, its first layer, and random models of other shapes on the same
    tokenizer (one whose heads the CPU's one-call decode step does not take, one whose it
    does)."""
    root = tmp_path_factory.mktemp("draft")
    target = build_model_dir(root / "target", "llama")
    weights = load_file(target / "model.safetensors")
    for name in weights:
        if "o_proj" in name or "down_proj" in name:
            weights[name] = weights[name] * 0.01
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    random_draft = build_model_dir(root / "random", "llama", seed=1, hidden_size=32,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1)
    one_call = build_model_dir(root / "one_call", "llama", seed=2, hidden_size=64,
                               num_hidden_layers=2, num_attention_heads=2,
                               num_key_value_heads=2)  # heads the one-call step takes
    return {"target": str(target), "layer0": _first_layer_draft(target, root / "layer0"),
            "random": str(random_draft), "one_call": str(one_call)}


def _spy_on_the_drafts_cpu_forward(llm: LLM) -> list[int]:
    """The longest query of each of the draft's forwards on the CPU."""
    drafter = llm.engine.executor.runner.drafter
    queries: list[int] = []
    if drafter.cpu is None:
        return queries
    forward = drafter.cpu.forward

    def spy(ids, positions, kv_caches, meta):
        queries.append(meta.max_query_len)
        return forward(ids, positions, kv_caches, meta)

    drafter.cpu.forward = spy
    return queries


def _spec(draft: str) -> dict:
    return {"model": draft, "num_speculative_tokens": 4}  # vLLM's spelling: no method


def test_config_takes_vllms_spelling_and_finds_a_shipped_draft(tmp_path):
    config = parse_speculative_config('{"model": "d", "num_speculative_tokens": 3}')
    assert (config.method, config.model, config.num_speculative_tokens) == ("draft_model", "d", 3)
    with pytest.raises(ValueError, match="draft_model method"):
        parse_speculative_config({"method": "ngram", "model": "d"})
    shipped = parse_speculative_config({"method": "draft_model"})
    with pytest.raises(ValueError, match="ships no draft"):
        resolve_draft_model(shipped, str(tmp_path))
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text("{}")
    assert resolve_draft_model(shipped, str(tmp_path)) == str(tmp_path / "draft")


@pytest.mark.gpu
@pytest.mark.parametrize("draft", ["target", "layer0", "random"])
def test_greedy_with_a_draft_gives_the_tokens_without(pair, draft):
    """The target as its own draft must see every proposal accepted: any stale or misplaced
    KV slot of the draft's (chunked prefill, prefix hits, preemption) would show as a
    rejection."""
    args = on_test_device(**ARGS)
    params = [SamplingParams(temperature=0.0, max_tokens=m, logprobs=2, ignore_eos=True)
              for m in (21, 16, 25, 12)]
    want = _completions(LLM(pair["target"], **args).generate(_prompts(), params,
                                                             use_tqdm=False))
    spec = speculating(LLM(pair["target"], speculative_config=_spec(pair[draft]), **args))
    queries = _spy_on_the_drafts_cpu_forward(spec)
    _assert_same(_completions(spec.generate(_prompts(), params, use_tqdm=False)), want)
    # on the CPU a catch-up (the last known token, the accepted run, the new token: up to
    # k + 2) runs as decode rows in the one-call decode step, never as a prefill-style chunk
    assert not [q for q in queries if 1 < q <= 4 + 2], queries
    if draft == "random":
        return
    # again: the prompts' blocks are cached, the draft's KV in them with the target's
    _assert_same(_completions(spec.generate(_prompts(), params, use_tqdm=False)), want)
    stats = spec.engine.stats()
    assert stats.prefix_cache_hits > 0
    accepted, drafted = stats.spec_decode_num_accepted_tokens, stats.spec_decode_num_draft_tokens
    assert accepted == drafted > 0 if draft == "target" else accepted > drafted / 3
    # preempted for KV blocks (7 blocks of 16 tokens, target and draft) and recomputed
    # (a token's KV: 512 bytes in the target's layers; the draft's own, and its scratch)
    draft_bytes = 512 if draft == "target" else 256
    squeezed = speculating(LLM(pair["target"], speculative_config=_spec(pair[draft]), **{
        **args, "kv_cache_memory": 7 * 16 * (512 + draft_bytes) + 8 * 16 * draft_bytes}))
    _assert_same(_completions(squeezed.generate(_prompts(), params, use_tqdm=False)), want)
    stats = squeezed.engine.stats()
    assert stats.num_preemptions > 0
    if draft == "target":
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens


def _record_proposals(llm: LLM) -> list[dict[str, list[int]]]:
    """Every proposal the draft makes, step by step."""
    drafter = llm.engine.executor.runner.drafter
    seen: list[dict[str, list[int]]] = []
    propose = drafter.propose

    def spy(batch, step):
        seen.append(propose(batch, step))
        return seen[-1]

    drafter.propose = spy
    return seen


@pytest.mark.parametrize("target", ["target", "one_call"])
def test_proposals_in_one_call_are_the_python_loops(pair, target):
    """On the CPU a draft's catch-up and guesses run in one call of its one-call decode step
    (``DecodeStack.propose``): step for step the proposals must be those of the Python loop
    over the draft's forwards, through catch-ups after rejections (a random draft's) and
    after full acceptances (a model as its own draft's: catch-ups of k + 2 rows)."""
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in (21, 16, 25, 12)]
    runs = []
    for one_call in (True, False):
        spec = speculating(LLM(pair[target], speculative_config=_spec(pair["one_call"]),
                               device="cpu", **ARGS))
        cpu = spec.engine.executor.runner.drafter.cpu
        taken: list[bool] = []
        chain = cpu.propose

        def counted(*args, chain=chain, one_call=one_call, taken=taken):
            out = chain(*args) if one_call else None
            taken.append(out is not None)
            return out

        cpu.propose = counted
        seen = _record_proposals(spec)
        runs.append((_completions(spec.generate(_prompts(), params, use_tqdm=False)), seen))
        if one_call:  # the steady steps (a verification's catch-up) all take it
            assert sum(taken) > len(taken) / 2, taken
        stats = spec.engine.stats()
        if target == "one_call":
            assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    assert runs[0] == runs[1]
    assert sum(len(p) for step in runs[0][1] for p in step.values()) > 40


@pytest.mark.gpu
def test_a_draft_catches_up_after_steps_without_proposals(pair):
    """A plain step (no proposals: ``core/spec_mode.py``) skips the draft; the next step that
    speculates runs what it missed, prompts included, in forwards of at most the step's
    budget. The target as its own draft must still have every proposal accepted."""
    args = on_test_device(**ARGS)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in (31, 26, 35, 22)]
    want = _completions(LLM(pair["target"], **args).generate(_prompts(), params,
                                                             use_tqdm=False))
    spec = speculating(LLM(pair["target"], speculative_config=_spec(pair["target"]), **args))
    pattern = itertools.cycle([False] * 6 + [True] * 3)  # the prompts: past the budget
    spec.engine.spec_modes.choose = lambda _running: next(pattern)
    assert _completions(spec.generate(_prompts(), params, use_tqdm=False)) == want
    stats = spec.engine.stats()
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0



@pytest.mark.gpu
def test_a_prefix_the_draft_never_ran_is_run_again_on_a_hit(pair):
    """Blocks filled by plain steps (no draft forward) hold no draft KV: a later request that
    hits them in the prefix cache must have the draft run its prefix, not read those blocks.
    The target as its own draft must still have every proposal accepted."""
    args = on_test_device(**ARGS)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in (31, 26, 35, 22)]
    spec = speculating(LLM(pair["target"], speculative_config=_spec(pair["target"]), **args))
    modes = spec.engine.spec_modes
    modes.choose = lambda _running: False  # the prompts' blocks cached, the draft never run
    want = _completions(spec.generate(_prompts(), params, use_tqdm=False))
    assert spec.engine.stats().spec_decode_num_draft_tokens == 0
    modes.choose = lambda _running: True
    assert _completions(spec.generate(_prompts(), params, use_tqdm=False)) == want
    stats = spec.engine.stats()
    assert stats.prefix_cache_hits > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0

@pytest.mark.gpu
def test_sampling_with_a_draft_keeps_the_targets_distribution(pair, tmp_path):
    """At temperature 1, the token after the first (the first the draft proposes for)
    follows HF transformers' distribution for that context."""
    target = Path(pair["target"])
    peaked = tmp_path / "peaked"  # a sharper head: few likely tokens, so few samples tell
    shutil.copytree(target, peaked)
    weights = load_file(target / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 2.5
    save_file(weights, peaked / "model.safetensors", metadata={"format": "pt"})
    draft = _first_layer_draft(peaked, tmp_path / "peaked-draft")
    prompt = _prompts()[3]
    n = 600
    spec = speculating(LLM(str(peaked), speculative_config=_spec(draft),
                           **on_test_device(dtype="float32", max_num_seqs=64)))
    # the third token only lets the second have a proposal (never past max_tokens)
    outs = spec.generate([prompt] * n, SamplingParams(temperature=1.0, max_tokens=3,
                                                      ignore_eos=True), use_tqdm=False)
    pairs = np.array([o.outputs[0].token_ids[:2] for o in outs])
    assert spec.engine.stats().spec_decode_num_accepted_tokens > 0
    first = int(np.bincount(pairs[:, 0]).argmax())
    seconds = pairs[pairs[:, 0] == first, 1]
    hf = AutoModelForCausalLM.from_pretrained(peaked, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + [first]])).logits[0, -1]
    expected = torch.softmax(logits.double(), -1).numpy()
    assert len(seconds) >= 100
    statistic, df = _chi_square(np.bincount(seconds, minlength=len(expected)),
                                expected * len(seconds))
    assert statistic < _chi_square_critical(df), (statistic, df, len(seconds))


def _chi_square(observed: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom, the categories expected fewer than 5
    times pooled into one."""
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1


def _chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square value exceeded with probability 0.001 (``z``: that normal quantile),
    by Wilson and Hilferty's approximation."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * c ** 0.5) ** 3


@pytest.mark.gpu
def test_the_embedded_model_with_its_shipped_draft_keeps_its_greedy_tokens():
    args = on_test_device(max_num_seqs=4, max_num_batched_tokens=32)
    prompts = ["ROMEO:\nBut soft, what light", "First Citizen:\nBefore we proceed any further",
               "KING RICHARD III:\nNow is the winter of our discontent"]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(**args).generate(prompts, params,
                                                                 use_tqdm=False)]
    spec = speculating(LLM(speculative_config={"method": "draft_model"}, **args))
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    stats = spec.engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 0.3 * stats.spec_decode_num_draft_tokens


def test_a_draft_with_another_vocabulary_is_refused(pair, tmp_path):
    other = build_model_dir(tmp_path / "other", "llama", vocab_size=600, hidden_size=32,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ValueError, match="vocabulary of 600 tokens.*share the target's"):
        LLM(pair["target"], speculative_config=_spec(str(other)), dtype="float32")


def test_a_draft_model_turns_async_scheduling_off_and_refuses_it() -> None:
    from tidal.core.config import DEFAULT_MODEL, EngineConfig

    spec = {"method": "draft_model"}
    assert EngineConfig(str(DEFAULT_MODEL), speculative_config=spec).async_scheduling is False
    with pytest.raises(ValueError, match="draft_model runs without async scheduling"):
        EngineConfig(str(DEFAULT_MODEL), speculative_config=spec, async_scheduling=True)
