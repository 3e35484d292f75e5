"""Quantizing a float model's linears at load (``--quantization int8|int4``).

Only the decoder layers' linears are quantized (attention's qkv and output projections, the
MLP's gate/up and down projections), which hold nearly all of a model's weight bytes at any
size that needs quantizing. The token embedding and the output head keep the model's dtype: the
embedding is a row lookup, not a matmul, so quantizing it saves memory and no time, and the
output head's error lands directly on every logprob; a tied head shares the embedding's weight.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from gpu.quantization.linear import QuantLinear
from gpu.quantization.weights import QuantizedWeight, quantize

logger = logging.getLogger(__name__)

METHODS = ("int8", "int4")
QUANTIZED_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def quantizable_linears(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """``(parent, attribute)`` of every decoder-layer linear that quantization replaces."""
    return [(parent, name) for layer in model.layers for parent in layer.modules()
            for name, child in parent.named_children()
            if name in QUANTIZED_LINEARS and isinstance(child, nn.Linear)]


def install(parent: nn.Module, name: str, weight: QuantizedWeight,
            bias: torch.Tensor | None, dtype: torch.dtype) -> QuantLinear:
    """Replace ``parent.name`` with a ``QuantLinear`` over ``weight``."""
    layer = QuantLinear(weight, bias, dtype)
    setattr(parent, name, layer)
    return layer


def quantize_model(model: nn.Module, method: str, group_size: int = 32) -> None:
    """Quantize the decoder layers' linears in place, one at a time, so the float copy of only
    one weight exists beside the quantized model at any moment."""
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}; got {method!r}")
    before = after = 0
    for parent, name in quantizable_linears(model):
        linear = getattr(parent, name)
        weight = quantize(linear.weight, method, group_size)
        before += linear.weight.nbytes
        after += weight.nbytes
        install(parent, name, weight, linear.bias, linear.weight.dtype)
        del linear
    logger.info("quantized the decoder layers' linears to %s%s: %.1f MB -> %.1f MB; the "
                "embedding and output head stay %s", method,
                f" (groups of {group_size})" if method == "int4" else " (per output channel)",
                before / 1e6, after / 1e6, str(model.embed_tokens.weight.dtype).removeprefix(
                    "torch."))
