"""GGUF files of the newer architectures, written here as llama.cpp's converter writes them:
mixture-of-experts files (``qwen3moe``, and Mixtral's ``llama`` with experts: each layer's
experts stacked per projection, the router as ``ffn_gate_inp``, quantized experts included),
and Gemma 2 / 3 files (norms stored as ``1 + w``, soft-caps, sliding windows). Their settings
come back from the metadata, and they serve HF transformers' greedy tokens and logprobs on the
same weights dequantized."""

from __future__ import annotations

import dataclasses
import json
import shutil

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from tests.device import on_test_device
from tests.gguf_writing import write_gguf
from tests.unit.gpu.test_gguf import _check_against_twin
from tidal.core import LLM
from tidal.gpu.checkpoints import experts_arrive_quantized
from tidal.gpu.checkpoints.gguf_file import gguf_weights
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.quantization.experts import QuantExperts
from tidal.gpu.random_model import build_model_dir

# experts in Q4_0 and Q8_0 (their rows are multiples of 32), attention in Q8_0
ARCHS = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}


def _types(layers: int) -> dict[str, T]:
    types: dict[str, T] = {}
    for layer in range(layers):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            types[f"blk.{layer}.{part}.weight"] = T.Q8_0
        types[f"blk.{layer}.ffn_gate_exps.weight"] = T.Q4_0
        types[f"blk.{layer}.ffn_up_exps.weight"] = T.Q8_0
        types[f"blk.{layer}.ffn_down_exps.weight"] = T.Q4_0
    return types


@pytest.fixture(scope="module", params=list(ARCHS))
def moe_gguf(request, tmp_path_factory):
    """The HF directory, its GGUF, and the HF model on the GGUF's weights dequantized."""
    root = tmp_path_factory.mktemp(f"gguf-{request.param}")
    model_dir = build_model_dir(root / "hf", request.param)
    config = json.loads((model_dir / "config.json").read_text())
    path = root / "model.gguf"
    twin_weights = write_gguf(model_dir, path, ARCHS[request.param],
                              _types(config["num_hidden_layers"]))
    return model_dir, path, _twin(root, model_dir, twin_weights)


def test_the_experts_settings_come_from_the_metadata(moe_gguf):
    model_dir, path, _ = moe_gguf
    got, want = ModelConfig.load(path), ModelConfig.from_dir(model_dir)
    assert (got.architecture, got.rope_theta) == (want.architecture, want.rope_theta)
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "norm_topk_prob", "mlp_only_layers", "intermediate_size"):
        assert getattr(got, key) == getattr(want, key), key


@pytest.mark.gpu
def test_moe_gguf_matches_hf_on_the_dequantized_weights(moe_gguf):
    _, path, twin = moe_gguf
    _check_against_twin(LLM(str(path), dtype="float32", **on_test_device()), twin)


# -- Gemma 2 and Gemma 3: norms stored as 1 + w, soft-caps, windows -----------------------------

GEMMA = {  # as llama.cpp can record them: the head size as the attention scale, Gemma 3's
    # local rotary base 10,000 and every sixth layer global; windows shorter than the prompts
    "gemma2": dict(query_pre_attn_scalar=32, num_hidden_layers=3),
    "gemma3": dict(query_pre_attn_scalar=32, num_hidden_layers=6, sliding_window_pattern=6,
                   rope_local_base_freq=10_000.0, final_logit_softcapping=4.0),
}


@pytest.fixture(scope="module", params=list(GEMMA))
def gemma_gguf(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"gguf-{request.param}")
    model_dir = build_model_dir(root / "hf", request.param, tie_word_embeddings=True,
                                **GEMMA[request.param])
    config = json.loads((model_dir / "config.json").read_text())
    types = {f"blk.{i}.{part}.weight": T.Q8_0 for i in range(config["num_hidden_layers"])
             for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                          "ffn_down")}
    path = root / "model.gguf"
    twin_weights = write_gguf(model_dir, path, request.param, types)
    return model_dir, path, _twin(root, model_dir, twin_weights)


def _twin(root, model_dir, weights) -> AutoModelForCausalLM:
    twin_dir = root / "twin"
    shutil.copytree(model_dir, twin_dir)
    save_file({k: torch.from_numpy(v.copy()) for k, v in weights.items()},
              twin_dir / "model.safetensors", metadata={"format": "pt"})
    twin = AutoModelForCausalLM.from_pretrained(twin_dir, dtype=torch.float32)
    twin.generation_config.eos_token_id = None
    return twin


def test_gemma_settings_come_from_the_metadata(gemma_gguf):
    model_dir, path, _ = gemma_gguf
    got, want = ModelConfig.load(path), ModelConfig.from_dir(model_dir)
    assert (got.architecture, got.rope_theta, got.head_dim) == \
        (want.architecture, want.rope_theta, want.head_dim)
    # the directory's names the default rope type, the file leaves it out
    assert dataclasses.replace(got.gemma, local_rope_scaling={}) == \
        dataclasses.replace(want.gemma, local_rope_scaling={})


@pytest.mark.gpu
def test_gemma_gguf_matches_hf_on_the_dequantized_weights(gemma_gguf):
    _, path, twin = gemma_gguf
    _check_against_twin(LLM(str(path), dtype="float32", **on_test_device()), twin)


# -- gpt-oss: MXFP4 experts split from the interleaved gate_up, sinks, YaRN -----------------

@pytest.fixture(scope="module")
def gpt_oss_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-gpt-oss")
    # the SwiGLU clamp as llama.cpp fixes it (the file does not record it)
    model_dir = build_model_dir(root / "hf", "gpt_oss", swiglu_limit=7.0)
    config = json.loads((model_dir / "config.json").read_text())
    types = {}
    for i in range(config["num_hidden_layers"]):
        types.update({f"blk.{i}.{part}.weight": T.Q8_0
                      for part in ("attn_q", "attn_k", "attn_v", "attn_output")})
        types.update({f"blk.{i}.{part}.weight": T.MXFP4
                      for part in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")})
    path = root / "model.gguf"
    twin_weights = write_gguf(model_dir, path, "gpt-oss", types)
    return model_dir, path, _twin(root, model_dir, twin_weights)


def test_gpt_oss_settings_come_from_the_metadata(gpt_oss_gguf):
    model_dir, path, _ = gpt_oss_gguf
    got, want = ModelConfig.load(path), ModelConfig.from_dir(model_dir)
    for key in ("architecture", "rope_theta", "head_dim", "num_experts", "num_experts_per_tok",
                "moe_intermediate_size", "gpt_oss", "o_bias", "qkv_bias"):
        assert getattr(got, key) == getattr(want, key), key
    assert {k: v for k, v in got.rope_scaling.items() if k not in ("rope_type", "rope_theta")} == \
        {k: v for k, v in want.rope_scaling.items() if k not in ("rope_type", "rope_theta")}


def test_gpt_oss_gguf_experts_are_read_in_mxfp4(gpt_oss_gguf):
    """Each expert's matrix a codebook weight, equal to the gguf package's dequantization of
    the stacked tensor, kept so by the loader."""
    _, path, _ = gpt_oss_gguf
    assert experts_arrive_quantized(path)
    stacked = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    weights = dict(gguf_weights(path))
    for part, name in (("ffn_gate_exps", "gate_proj"), ("ffn_up_exps", "up_proj"),
                       ("ffn_down_exps", "down_proj")):
        t = stacked[f"blk.1.{part}.weight"]
        want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))
        for e in range(want.shape[0]):
            got = weights[f"model.layers.1.mlp.experts.{e}.{name}.weight"]
            assert got.codebook is not None and got.bits == 4
            assert torch.equal(got.dequantize(), want[e]), (part, e)


@pytest.mark.gpu
def test_gpt_oss_gguf_matches_hf_on_the_dequantized_weights(gpt_oss_gguf):
    """On the exact path (the CPU kernels off: the MXFP4 experts as the int8 weights they
    equal, through torch's path)."""
    _, path, twin = gpt_oss_gguf
    llm = LLM(str(path), dtype="float32", **on_test_device(cpu_kernels="off"))
    assert isinstance(llm.engine.executor.runner.model.layers[0].mlp.experts, QuantExperts)
    _check_against_twin(llm, twin)
