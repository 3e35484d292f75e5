"""Quantizing a float model's linears as they are read (``--quantization int8|int4``).

The decoder layers' linears are quantized in the format asked for (attention's qkv and output
projections, the MLP's gate/up and down projections, a MoE block's experts', ``experts.py``;
its router stays in the model's dtype), which hold nearly all of a model's weight bytes at any
size that needs quantizing. The output head becomes int8 with one scale per row
(``head.py``): finer, because its error lands directly on every logprob, and quantized at all
because at batch 1 a small model's head is a large share of a step's bytes. An untied token
embedding becomes int8 per row too (a row lookup, not a matmul: it saves memory, no time, and a
large vocabulary's table is a large share of a 4-bit MoE's resident bytes); a tied one is the
head's int8 weight, which would otherwise be kept twice, as the embedding's rows and in the
layout the head's matmul runs from.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tidal.core.config import QUANTIZATIONS
from tidal.gpu.moe import MoE
from tidal.gpu.moe_weights import expert_slot
from tidal.gpu.quantization.experts import quantize_experts_on_read
from tidal.gpu.quantization.head import QuantEmbedding
from tidal.gpu.quantization.linear import QuantLinear
from tidal.gpu.quantization.weights import QuantizedWeight, Weight, quantize

logger = logging.getLogger(__name__)

QUANTIZED_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# The same linears as checkpoints name them, before q/k/v and gate/up are fused
CHECKPOINT_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                      "down_proj")


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


def leave_unallocated(model: nn.Module) -> None:
    """Give the quantizable linears of a model still on the meta device empty weights, so that
    allocating the model leaves them out: their quantized weights replace them as read."""
    for parent, name in quantizable_linears(model):
        getattr(parent, name).weight = nn.Parameter(torch.empty(0, device="meta"))


def quantized_bytes(model: nn.Module, method: str | None, group_size: int) -> int:
    """The bytes the decoder linears' and experts' weights of ``model`` (still on the meta
    device, its float weights in place) will take once quantized by ``method`` (None: the
    experts only, as they arrive in MXFP4): what decides, before any is read, whether the
    model keeps one layout per weight."""
    shapes = [] if method is None else [tuple(getattr(parent, name).weight.shape)
                                        for parent, name in quantizable_linears(model)]
    for moe in model.modules():
        if isinstance(moe, MoE):
            shapes += [tuple(p.shape[1:]) for p in (moe.experts.gate_up_proj,
                                                    moe.experts.down_proj)
                       for _ in range(p.shape[0])]
    return sum(_nbytes(n, k, method, group_size) for n, k in shapes)


def _nbytes(out: int, inp: int, method: str | None, group_size: int) -> int:
    """``QuantizedWeight.nbytes`` of an ``[out, inp]`` weight quantized by ``method`` (None:
    MXFP4, a scale byte per 32 values)."""
    if method == "int8":  # one float32 scale per row
        return out * inp + out * 4
    if method is None:
        return out * inp // 2 + out * (inp // 32)
    return out * inp // 2 + out * (inp // group_size) * 2 * 4  # a scale and an offset a group


def quantize_on_read(weights: Iterable[tuple[str, Weight]], method: str, group_size: int = 32
                     ) -> Iterator[tuple[str, Weight]]:
    """The checkpoint's weights with every float decoder-layer linear weight quantized as it
    arrives (q, k and v apart: quantization is row by row, so fusing after is the same), the
    experts' too, one expert at a time (``experts.py``)."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; "
                         f"got {method!r}")
    for name, value in weights:
        experts = quantize_experts_on_read(name, value, method, group_size)
        if experts is not None:  # a MoE's stacked experts, each expert's apart
            yield from experts
            continue
        if isinstance(value, torch.Tensor) and _quantizable(name):
            value = quantize(value, method, group_size)
        yield name, value


def _quantizable(name: str) -> bool:
    """A decoder layer's linear weight, or one expert's (Mixtral's ``w1``/``w3``/``w2``)."""
    parts = name.split(".")
    if "layers" not in parts or len(parts) < 2 or parts[-1] != "weight":
        return False
    slot = expert_slot(name)
    return parts[-2] in CHECKPOINT_LINEARS or (slot is not None and slot.expert is not None)


def log_quantized(model: nn.Module, method: str | None, group_size: int) -> None:
    """What ``--quantization`` (``method``; None: none) quantized, and the experts read in
    MXFP4 and kept so."""
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    kept = [m for m in quantized if m.codebook]
    if kept:
        logger.info("kept %d experts' linears in MXFP4, as read: %.1f MB", len(kept),
                    sum(m.format_nbytes for m in kept) / 1e6)
    if method is not None:
        _log_method(model, [m for m in quantized if not m.codebook], method, group_size)


def _log_method(model: nn.Module, layers: list[QuantLinear], method: str,
                group_size: int) -> None:
    size = sum(m.format_nbytes for m in layers)
    how = f"groups of {group_size}" if method == "int4" else "per output channel"
    head = model.lm_head
    embed = model.embed_tokens
    if isinstance(embed, QuantEmbedding) and embed.weight_format is getattr(
            head, "weight_format", None):
        rest = f"the tied embedding and output head are one int8 weight (per row): {_mb(head)}"
    elif isinstance(embed, QuantEmbedding):
        rest = (f"the output head and the embedding are int8 (per row): "
                f"{_mb(head)} and {_mb(embed)}")
    else:
        rest = f"the output head is int8 (per row): {_mb(head)}; the embedding is as read"
    logger.info("quantized %d decoder linears to %s (%s): %.1f MB; %s", len(layers), method,
                how, size / 1e6, rest)


def _mb(layer: nn.Module | None) -> str:
    weight = getattr(layer, "weight_format", None)
    nbytes = getattr(layer, "format_nbytes", None) or (
        weight.nbytes if weight is not None else None)
    return "-" if nbytes is None else f"{nbytes / 1e6:.1f} MB"
