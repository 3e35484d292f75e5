"""Reading a model's weights from the checkpoint formats users have, as ``(name, value)``
pairs in Hugging Face's naming (``model.layers.0.self_attn.q_proj.weight``): a value is a
float tensor, or a ``QuantizedWeight`` that stays quantized (``gpu/quantization/weights.py``).
``gpu/model_loader.py`` maps the names onto the model and installs the quantized linears."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from tidal.core.config import is_gguf_file
from tidal.gpu.checkpoints.gguf_file import all_linears_quantized, experts_in_mxfp4, gguf_weights
from tidal.gpu.checkpoints.quantized import quantized_weights
from tidal.gpu.checkpoints.safetensors_files import iter_safetensors
from tidal.gpu.quantization.weights import Weight


def checkpoint_weights(model_dir: str | Path) -> Iterator[tuple[str, Weight]]:
    """The checkpoint's weights, by its format: a GGUF file, or a Hugging Face directory."""
    if is_gguf_file(model_dir):
        return gguf_weights(model_dir)
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    quantization = config.get("quantization_config")
    if quantization:
        return quantized_weights(model_dir, quantization)
    return iter_safetensors(model_dir)


def experts_arrive_quantized(model_dir: str | Path) -> bool:
    """Whether the checkpoint's MoE experts are read as quantized weights to be kept so
    without ``--quantization``: MXFP4 ones (a checkpoint's, ``mxfp4.py``; a GGUF's)."""
    if is_gguf_file(model_dir):
        return experts_in_mxfp4(model_dir)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    method = (config.get("quantization_config") or {}).get("quant_method", "")
    return str(method).lower() == "mxfp4"


def linears_arrive_quantized(model_dir: str | Path) -> bool:
    """Whether every decoder-layer linear weight of the checkpoint is read quantized, so the
    model need not allocate float ones (a 3B model's would take 12 GB in float32)."""
    return is_gguf_file(model_dir) and all_linears_quantized(model_dir)
