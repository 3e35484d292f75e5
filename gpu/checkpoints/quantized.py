"""Which reader reads a checkpoint whose config.json names a ``quantization_config``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from tidal.gpu.checkpoints.compressed_tensors import compressed_tensors_weights
from tidal.gpu.checkpoints.gptq_awq import awq_weights, gptq_weights
from tidal.gpu.checkpoints.int_packing import Weight
from tidal.gpu.checkpoints.mxfp4 import mxfp4_weights

READERS: dict[str, Callable[[Path, dict], Iterator[tuple[str, Weight]]]] = {
    "gptq": gptq_weights,
    "awq": awq_weights,
    "compressed-tensors": compressed_tensors_weights,
    "mxfp4": mxfp4_weights,  # gpt-oss's experts, dequantized to float as they are read
}


def quantized_weights(model_dir: Path, config: dict) -> Iterator[tuple[str, Weight]]:
    """The weights of a checkpoint quantized as ``config`` (its ``quantization_config``)
    says; a method tidal does not read is refused by name."""
    method = str(config.get("quant_method", "")).lower()
    if method not in READERS:
        raise ValueError(f"{model_dir} holds a {method!r} quantized checkpoint, which tidal "
                         f"does not read (it reads {', '.join(READERS)})")
    return READERS[method](model_dir, config)
