"""Quantized models: tidal's int8/int4 engine equals HF transformers running the same quantized
weights dequantized into a float model, under every condition float models are tested in; and
the quantization itself stays within its stated bounds of the float original (top logprobs,
held-out loss of the embedded model)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.device import TEST_DEVICE
from tests.hf_reference import (
    NEW_TOKENS,
    check_against_hf,
    fidelity_llm,
    hf_greedy,
    reference_prompts,
    replace_hf_linears,
)
from tests.marks import quick_only
from tests.paths import DATA
from tidal.core import DEFAULT_MODEL, SamplingParams
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.quantization import linear
from tidal.gpu.quantization.linear import DOT, QuantLinear, round_activations
from tidal.gpu.quantization.weights import quantize, quantize_int8
from tidal.gpu.random_model import build_model_dir
from tidal.gpu.training.heldout import nats_per_char

pytestmark = pytest.mark.gpu

HELD_OUT = DATA / "heldout-shakespeare.txt"
FORMATS = {"int8": ("int8", 32), "int4g32": ("int4", 32), "int4g64": ("int4", 64)}
# Bounds against the float original: the top logprob at each of the float run's tokens (nats,
# for TOP_LOGPROB_SHARE of them), and the embedded model's held-out loss (nats per character)
# rising by at most a fraction. A random network is chaotic: any perturbation of its weights
# moves its logits several times further than a trained one's, so its bound is wider, and its
# share noise-bound too (int8 embedding rows took random Qwen3's from 0.996 to 0.988; rows in
# groups of 32 only to 0.990).
TOP_LOGPROB_NATS = {"default": 0.05, "llama": 0.1, "qwen3": 0.1}
TOP_LOGPROB_SHARE = {"default": 0.99, "llama": 0.98, "qwen3": 0.98}
HELD_OUT_RISE = {"int8": 0.01, "int4g32": 0.05}
# The most a greedy step of the random Llama on the dot kernel moves from HF multiplying the
# same rounded rows: inputs rounded apart at a boundary, carried on by the later steps.
FLIPPED_ROUNDING_NATS = 0.15


def hf_twin(path: str, fmt: str, rounded: bool = False):
    """HF's float model of ``path`` with its decoder linears quantized as ``fmt`` and
    dequantized, and the output head (and a tied embedding, the same weight) as int8 per row;
    an untied embedding as read, as tidal keeps one in the checkpoint's dtype: the reference
    tidal's quantized engine is held to. ``rounded``: its linears and
    head as the dot kernel multiplies, with float16 scales and offsets and inputs rounded to
    int8 per block."""
    method, group = FORMATS[fmt]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(TEST_DEVICE)
    if rounded:
        replace_hf_linears(hf, lambda name, w: quantize(w.cpu(), method, group)
                           .float16_params().dequantize())
        for module in hf.model.layers.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(lambda _, args: (round_activations(args[0]),))
    else:
        replace_hf_linears(hf, lambda name, w: quantize(w.cpu(), method, group).dequantize())
    head = hf.get_output_embeddings().weight  # a tied model's embedding too
    int8_head = quantize_int8(head.cpu())
    with torch.no_grad():
        head.copy_(int8_head.dequantize().to(head.device))
    if rounded:  # the head on the dot kernel; a tied embedding keeps the exact rows
        hf.lm_head.weight = torch.nn.Parameter(
            int8_head.float16_params().dequantize().to(head.device))
        hf.lm_head.register_forward_pre_hook(lambda _, args: (round_activations(args[0]),))
    hf.generation_config.eos_token_id = None
    hf.reference_cache = {}
    return hf


_BUILT: dict[str, str] = {}


def model_dir(arch: str, tmp_path_factory, **overrides) -> str:
    if arch not in _BUILT:
        _BUILT[arch] = str(build_model_dir(tmp_path_factory.mktemp(arch), arch.split("-")[0],
                                           **overrides))
    return _BUILT[arch]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("arch", quick_only(["llama", "qwen2", "qwen3"], "llama"))
def test_quantized_engine_equals_hf_on_the_dequantized_weights(arch, fmt, tmp_path_factory):
    path = model_dir(arch, tmp_path_factory)
    method, group = FORMATS[fmt]
    llm = fidelity_llm(path, quantization=method, quantization_group_size=group)
    check_against_hf(hf_twin(path, fmt), llm, reference_prompts(0), tol=2e-4)


@pytest.mark.cpu_only(reason="the dot kernel is a CPU kernel")
@pytest.mark.parametrize("fmt", quick_only(["int8", "int4g32"], "int4g32"))
def test_engine_on_the_dot_kernel_follows_hf_on_rounded_activations(fmt, tmp_path_factory,
                                                                    monkeypatch):
    """Every quantized linear and the int8 head on the dot kernel (the first candidate once
    tidal's float kernel is ruled out), the one-call decode step included, against HF
    multiplying as it does.

    Not to float tolerance throughout: where an input lands within float noise of a rounding
    boundary (x * 127 / amax at a half), the two round it apart, one step of its block's
    scale, and a random network carries that on through the cache. So most greedy steps must
    agree to float rounding, and every one within ``FLIPPED_ROUNDING_NATS``."""
    from tidal.gpu.cpu.kernels import load_cpu_kernels

    kernels = load_cpu_kernels()
    if kernels is None or kernels.dot_linear_tile()[0] == 0:
        pytest.skip("needs the C++ kernels built for AVX2 or later")
    monkeypatch.setattr(linear, "_tidal_fits", lambda w: False)
    path = str(build_model_dir(tmp_path_factory.mktemp("llama-128"), "llama", hidden_size=128))
    method, group = FORMATS[fmt]
    llm = fidelity_llm(path, quantization=method, quantization_group_size=group)
    model = llm.engine.executor.runner.model
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.plan.used() == {DOT} for m in layers)
    assert model.lm_head.plan.used() == {DOT}  # the int8 head, on the dot kernel too
    assert llm.engine.executor.runner.cpu.stack is not None
    hf = hf_twin(path, fmt, rounded=True)
    prompts = reference_prompts(0)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                            logprobs=1)
    diffs = []
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        ref_ids, ref_logprobs = hf_greedy(hf, prompt)
        got = out.outputs[0]
        for step, (token, want) in enumerate(zip(got.token_ids, ref_ids)):
            diffs.append(abs(got.logprobs[step][token] - ref_logprobs[step, token].item()))
            if token != want:
                break
    diffs = torch.tensor(diffs)
    assert len(diffs) >= len(prompts) * NEW_TOKENS // 2
    assert diffs.median() < 1e-4
    assert diffs.max() < FLIPPED_ROUNDING_NATS


@pytest.mark.parametrize("fmt", ["int8", "int4g32"])
def test_tied_quantized_head_engine_equals_hf_on_the_dequantized_weights(fmt, tmp_path_factory):
    path = model_dir("qwen2-tied", tmp_path_factory, tie_word_embeddings=True)
    method, group = FORMATS[fmt]
    llm = fidelity_llm(path, quantization=method, quantization_group_size=group)
    check_against_hf(hf_twin(path, fmt), llm, reference_prompts(0), tol=2e-4)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int8", "int4g32"])
def test_quantized_engine_holds_under_chunking_preemption_prefix_hits_and_async(
        fmt, tmp_path_factory):
    path = model_dir("llama", tmp_path_factory)
    method, group = FORMATS[fmt]
    blocks = 20 * 16 * ModelConfig.from_dir(path).kv_bytes_per_token(4)
    llm = fidelity_llm(path, quantization=method, quantization_group_size=group,
                       async_scheduling=True, max_num_batched_tokens=48,
                       kv_cache_memory=blocks, enable_prefix_caching=True)
    prompts = reference_prompts(1, shared_prefix=40)
    llm.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)
    check_against_hf(hf_twin(path, fmt), llm, prompts, tol=2e-4)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert llm.engine.kv.pool.num_free_blocks == 20


def test_quantized_n_choices_sample_apart_and_greedy_choices_agree(tmp_path_factory):
    path = model_dir("llama", tmp_path_factory)
    llm = fidelity_llm(path, quantization="int4")
    prompt = reference_prompts(2)[3]
    sampled = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7,
                                                     max_tokens=16, ignore_eos=True),
                           use_tqdm=False)[0].outputs
    assert len({tuple(c.token_ids) for c in sampled}) == 3
    greedy = llm.generate([prompt], SamplingParams(n=2, temperature=0.0, max_tokens=16,
                                                    ignore_eos=True), use_tqdm=False)[0].outputs
    assert greedy[0].token_ids == greedy[1].token_ids


def top_logprobs(hf, sequences: list[list[int]], prompt_lens: list[int]) -> torch.Tensor:
    """Teacher-forced: at each generated position, the top logprob ``hf`` gives."""
    tops = []
    with torch.no_grad():
        for seq, start in zip(sequences, prompt_lens):
            logits = hf(torch.tensor([seq], device=TEST_DEVICE)).logits[0].float()
            logprobs = torch.log_softmax(logits[start - 1:-1], dim=-1)
            tops.append(logprobs.max(dim=-1).values.cpu())
    return torch.cat(tops)


def float_continuations(hf, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=TEST_DEVICE)
        seq = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                          min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        out.append(seq[0].tolist())
    return out


def unit_gain_dir(arch: str, tmp_path_factory) -> str:
    """A random model 256 wide whose weights keep activations at unit scale (std
    1/sqrt(fan_in), as trained models roughly do), rather than the test models' peaky ones."""
    path = build_model_dir(tmp_path_factory.mktemp(f"{arch}-unit"), arch, hidden_size=256,
                           intermediate_size=512)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0.0, p.shape[1] ** -0.5)
    hf.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("rounded", [False, True], ids=["float-activations", "int8-activations"])
@pytest.mark.parametrize("which", quick_only(["default", "llama", "qwen3"], "default"))
def test_int8_top_logprobs_stay_within_bounds_of_float(which, rounded, tmp_path_factory):
    """8 prompts x 64 greedy float tokens: the int8 model's top logprob at each stays within
    ``TOP_LOGPROB_NATS`` of the float model's for ``TOP_LOGPROB_SHARE`` of them, with float
    activations and with the dot kernel's int8 ones."""
    fmt = "int8"
    path = DEFAULT_MODEL if which == "default" else unit_gain_dir(which, tmp_path_factory)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(TEST_DEVICE).eval()
    hf.generation_config.eos_token_id = None
    prompts = [p[:24] for p in reference_prompts(3)]
    prompts = [p if p else [6] for p in prompts]
    sequences = float_continuations(hf, prompts, 64)
    lens = [len(p) for p in prompts]
    ref = top_logprobs(hf, sequences, lens)
    got = top_logprobs(hf_twin(path, fmt, rounded).eval(), sequences, lens)
    assert ref.numel() == 8 * 64
    within = ((got - ref).abs() <= TOP_LOGPROB_NATS[which]).float().mean().item()
    assert within >= TOP_LOGPROB_SHARE[which], f"only {within:.3f} of tokens within bounds"


@pytest.mark.slow
@pytest.mark.parametrize("rounded", [False, True], ids=["float-activations", "int8-activations"])
@pytest.mark.parametrize("fmt", sorted(HELD_OUT_RISE))
def test_embedded_model_held_out_loss_rises_within_bounds(fmt, rounded):
    text, tokenizer, base = _held_out_base()
    quantized = nats_per_char(hf_twin(DEFAULT_MODEL, fmt, rounded).cpu().eval(), tokenizer, text,
                              HELD_OUT_CONTEXT)
    assert quantized <= base * (1 + HELD_OUT_RISE[fmt]), (base, quantized)


HELD_OUT_CONTEXT = 256


@functools.cache
def _held_out_base() -> tuple[str, Any, float]:
    """The held-out text, the embedded model's tokenizer, and the float model's loss on it
    (nats per character), computed once for every format."""
    text = HELD_OUT.read_text(encoding="utf-8")[:40_000]
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    return text, tokenizer, nats_per_char(hf, tokenizer, text, HELD_OUT_CONTEXT)
