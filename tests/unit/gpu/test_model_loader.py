"""Loading Hugging Face model directories: sharded weights, dtypes and clear errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from tests.paths import ROOT
from tidal.core import LLM, SamplingParams
from tidal.gpu.attention import get_attention_backend
from tidal.gpu.cpu.packed_linear import PackedLinear
from tidal.gpu.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from tidal.gpu.model_loader import LoadOptions, _uninitialized_layers, read_model, resolve_dtype
from tidal.gpu.models import MODELS
from tidal.gpu.random_model import build_model_dir

PROMPTS = [[7, 8, 9, 10, 11], [40, 41, 42]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("loader") / "llama", "llama")


def _greedy(path) -> list[list[int]]:
    outputs = LLM(str(path)).generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_sharded_checkpoint_gives_the_same_tokens(model_dir, tmp_path):
    sharded = tmp_path / "sharded"
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.save_pretrained(sharded, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, sharded / name)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert _greedy(sharded) == _greedy(model_dir)


def test_unsupported_architecture_lists_the_supported_ones(model_dir, tmp_path):
    other = tmp_path / "gpt2ish"
    shutil.copytree(model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'.*"
                                         "LlamaForCausalLM.*Qwen3ForCausalLM"):
        ModelConfig.from_dir(other)


def test_every_supported_architecture_has_a_model_class():
    assert set(MODELS) == set(SUPPORTED_ARCHITECTURES)


def test_attention_cost_context_weighs_attention_against_the_linears(model_dir):
    """A 30M Llama (hidden 512, 8 heads and 4 KV heads of 64, MLP 1,408): per token and layer
    the linears take 2 x 2.95M FLOPs, attention 4 x 512 a cached position: even at 2,880."""
    dims = dict(architecture="LlamaForCausalLM", vocab_size=8192, hidden_size=512,
                intermediate_size=1408, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64,
                rms_norm_eps=1e-6, max_position_embeddings=4096, rope_theta=1e4)
    assert ModelConfig(**dims).attention_cost_context() == 2880
    config = ModelConfig.from_dir(model_dir)
    assert LLM(str(model_dir)).engine.scheduler.config.attention_cost_context == (
        config.attention_cost_context())


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path / "nowhere"))


def test_dtypes_resolve_and_bfloat16_runs(model_dir):
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("float8", "cpu")
    llm = LLM(str(model_dir), dtype="bfloat16")
    assert llm.engine.executor.runner.model.embed_tokens.weight.dtype == torch.bfloat16
    out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)


def test_cpu_model_runs_on_packed_linear_layers(model_dir):
    model = LLM(str(model_dir)).engine.executor.runner.model
    assert isinstance(model.lm_head, PackedLinear)
    assert all(isinstance(layer.mlp.down_proj, PackedLinear) for layer in model.layers)


def test_float16_runs_on_the_cpu_like_float32(model_dir):
    """float16 takes the kernels (unpacked linears: oneDNN packing is float32/bfloat16 only)."""
    half = LLM(str(model_dir), dtype="float16").generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in half)
    assert [o.outputs[0].token_ids[:2] for o in half] == [t[:2] for t in _greedy(model_dir)]


@pytest.mark.slow
def test_loading_a_model_imports_no_compiler(model_dir):
    """A model is built on the meta device before its weights are read; initializers and
    maths on meta tensors run through torch's Python reference ops, which import
    torch._dynamo (and Triton with it) into a process that never compiles."""
    code = ("import sys; from tidal import LLM; LLM(sys.argv[1]); "
            "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'; "
            "assert 'triton' not in sys.modules, 'triton was imported'")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code, str(model_dir)], check=True, env=env,
                   cwd=ROOT, timeout=600)


def test_layers_are_initialized_again_once_the_model_is_built():
    before = (torch.nn.Linear.reset_parameters, torch.nn.Embedding.reset_parameters)
    with _uninitialized_layers():
        assert torch.nn.Linear(4, 4, device="meta").weight.is_meta
    assert (torch.nn.Linear.reset_parameters, torch.nn.Embedding.reset_parameters) == before
    assert torch.nn.Linear(64, 64).weight.abs().sum() > 0  # initialized, not left empty


def _mapped_file(address: int) -> str | None:
    """The file mapped at ``address`` in this process (``/proc/self/maps``), if any."""
    for line in open("/proc/self/maps"):
        fields = line.split()
        start, end = (int(a, 16) for a in fields[0].split("-"))
        if start <= address < end:
            return fields[5] if len(fields) > 5 else None
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_an_untied_embedding_in_the_models_dtype_is_the_checkpoints_mapping(tmp_path):
    """Read in the checkpoint's dtype (with or without --quantization), the untied embedding is
    the safetensors file's memory map itself, not a copy: its rows stay on disk until looked
    up. In another dtype it is converted (or int8 rows under --quantization)."""
    path = build_model_dir(tmp_path / "untied", "llama", tie_word_embeddings=False)
    cfg = ModelConfig.from_dir(path)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        table = f.get_tensor("model.embed_tokens.weight")
    assert table.dtype == torch.float32
    for quantization in (None, "int8"):
        model = read_model(path, cfg, LoadOptions(get_attention_backend("cpu", "cpu"), 64,
                                                  torch.float32, "cpu",
                                                  quantization=quantization))
        weight = model.embed_tokens.weight
        assert _mapped_file(weight.data_ptr()) == str(path / "model.safetensors")
        assert torch.equal(weight, table)
        ids = torch.tensor([[1, 5, table.shape[0] - 1]])
        assert torch.equal(model.embed_tokens(ids), table[ids])
    converted = read_model(path, cfg, LoadOptions(get_attention_backend("cpu", "cpu"), 64,
                                                  torch.bfloat16, "cpu"))
    assert _mapped_file(converted.embed_tokens.weight.data_ptr()) != str(path / "model.safetensors")
    assert torch.equal(converted.embed_tokens.weight, table.to(torch.bfloat16))
