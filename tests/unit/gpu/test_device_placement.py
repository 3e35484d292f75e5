"""Every tensor a loaded model holds is on the model's device, whatever the checkpoint's format.

Checkpoints are read on the CPU; the parameters' ``copy_`` moves float weights, but a quantized
weight replaces its layer whole and is moved by the loader alone. Loaded on the ``meta``
device, any tensor left behind on the CPU shows up here without a GPU: on a GPU it is the
"Expected all tensors to be on the same device" of the first forward.
"""

from __future__ import annotations

import json
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from tidal.gpu.attention import get_attention_backend
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.model_loader import LoadOptions, read_model
from tidal.gpu.quantization.head import QuantEmbedding, QuantHead
from tidal.gpu.quantization.linear import QuantLinear
from tidal.gpu.random_model import build_model_dir


def stray_tensors(obj: object, device: str, path: str = "model",
                  seen: set[int] | None = None) -> list[str]:
    """Where ``obj`` (a module, and whatever its attributes hold: quantized weights, their
    packs, lists, dicts) keeps a tensor off ``device``."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [] if obj.device.type == device else [f"{path} on {obj.device}"]
    if isinstance(obj, nn.Module):
        children = {**obj._parameters, **obj._buffers, **obj._modules,
                    **{k: v for k, v in vars(obj).items() if not k.startswith("_")}}
    elif is_dataclass(obj) and not isinstance(obj, type):
        children = {f.name: getattr(obj, f.name) for f in fields(obj)}
    elif isinstance(obj, (list, tuple)):
        children = dict(enumerate(obj))
    elif isinstance(obj, dict):
        children = obj
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("gpu."):
        children = vars(obj)  # tidal's own holders (QuantPacks)
    else:
        return []
    return [stray for key, child in children.items()
            for stray in stray_tensors(child, device, f"{path}.{key}", seen)]


def _load_on_meta(path: Path, quantization: str | None = None) -> nn.Module:
    backend = get_attention_backend("torch", "cpu")
    model = read_model(path, ModelConfig.load(path),
                       LoadOptions(backend, 256, torch.float32, "meta", quantization=quantization))
    for layer in model.modules():  # pack as a first forward would
        if isinstance(layer, (QuantLinear, QuantHead)) and layer.packs is None:
            layer.replan(layer.plan)
    return model


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("placement")
    return {"untied": build_model_dir(root / "untied", "llama", hidden_size=64),
            "tied": build_model_dir(root / "tied", "qwen2", hidden_size=64,
                                    tie_word_embeddings=True)}


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
@pytest.mark.parametrize("tie", ["untied", "tied"])
def test_float_checkpoints_load_whole_onto_the_device(model_dirs, quantization, tie):
    model = _load_on_meta(model_dirs[tie], quantization)
    if quantization is not None:
        assert isinstance(model.lm_head, QuantHead)
        if tie == "tied":  # one int8 weight, the head's
            assert model.embed_tokens.weight_format is model.lm_head.weight_format
        else:  # the checkpoint's own, in the model's dtype: as read
            assert not isinstance(model.embed_tokens, QuantEmbedding)
        assert any(isinstance(m, QuantLinear) for m in model.modules())
    assert stray_tensors(model, "meta") == []


def test_gguf_files_load_whole_onto_the_device(tmp_path):
    from tests.gguf_writing import write_gguf
    from tests.unit.gpu.test_gguf import SHAPE, _types

    model_dir = build_model_dir(tmp_path / "hf", "llama", **SHAPE)
    path = tmp_path / "model.gguf"
    write_gguf(model_dir, path, "llama", _types(json.loads((model_dir / "config.json")
                                                           .read_text())))
    model = _load_on_meta(path)
    assert any(isinstance(m, QuantLinear) for m in model.modules())
    assert stray_tensors(model, "meta") == []


@pytest.mark.parametrize("fmt", ["gptq-v1-int4-g32", "awq-g32", "ct-w8-channel"])
def test_quantized_checkpoints_load_whole_onto_the_device(tmp_path, fmt):
    from tests.unit.gpu.test_gptq_awq import FORMATS, build_checkpoint

    model = _load_on_meta(build_checkpoint(tmp_path, FORMATS[fmt]).path)
    assert any(isinstance(m, QuantLinear) for m in model.modules())
    assert stray_tensors(model, "meta") == []


def test_a_tensor_left_on_the_cpu_is_found():
    layer = nn.Module()
    layer.weight_format = {"q": torch.zeros(2, device="meta"), "scales": torch.zeros(2)}
    assert stray_tensors(layer, "meta") == ["model.weight_format.scales on cpu"]
