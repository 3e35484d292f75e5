"""Where a checkpoint's expert weights go in a MoE model's stacked parameters (``gpu/moe.py``).

Checkpoints hold experts in one of two forms, and both load:

- fused, as transformers 5 holds them in memory: ``mlp.experts.gate_up_proj`` ``[E, 2*I, H]``
  and ``mlp.experts.down_proj`` ``[E, H, I]``, the model's own names (no mapping needed);
- per expert, as published checkpoints are: Qwen3-MoE's
  ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`` and Mixtral's
  ``block_sparse_moe.experts.{e}.w1/w3/w2.weight`` (gate, up, down), each into its expert's
  slice of the stacked parameter. Mixtral's router, ``block_sparse_moe.gate``, is ``mlp.gate``.

gpt-oss's checkpoints hold its experts as HF does in memory, transposed and interleaved:
``mlp.experts.gate_up_proj`` ``[E, H, 2*I]`` with the gate and up columns alternating (its bias
``[E, 2*I]`` too), ``mlp.experts.down_proj`` ``[E, I, H]``, and the router as ``mlp.router``
(an MXFP4 checkpoint's biases and router too; its experts come per expert, below).
``gpt_oss_layout`` puts them in the MoE block's ``[E, out, in]`` gate-then-up layout.

Quantized expert weights (a GGUF's, a quantized checkpoint's) are dequantized into the model's
dtype, except under ``--quantization``, which keeps every expert quantized
(``gpu/quantization/experts.py``), and an MXFP4 checkpoint's, which stay in MXFP4 (read one
expert at a time under the per-expert names, ``gpu/checkpoints/mxfp4.py``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from tidal.gpu.gpt_oss_config import GPT_OSS
from tidal.gpu.quantization.weights import QuantizedWeight, Weight

_PER_EXPERT = re.compile(r"^(?:model\.)?(layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\."
                         r"(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_MIXTRAL_BLOCK = re.compile(r"^(?:model\.)?(layers\.\d+)\.block_sparse_moe\.(.+)$")
# a gpt-oss checkpoint's MLP weight: (the layer's mlp prefix, its part)
_GPT_OSS_MLP = re.compile(r"^(?:model\.)?(layers\.\d+\.mlp)\.(router\.(?:weight|bias)|"
                          r"experts\.(?:gate_up_proj|down_proj)(?:_bias)?)$")
# a per-expert matrix's name -> (stacked parameter, which half of gate_up: 0 gate, 1 up)
_PARTS = {"gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0),
          "up_proj": ("gate_up_proj", 1), "w3": ("gate_up_proj", 1),
          "down_proj": ("down_proj", None), "w2": ("down_proj", None)}


@dataclass(frozen=True)
class ExpertSlot:
    """A checkpoint weight's place: the parameter ``target``, and where ``expert`` is set, that
    expert's matrix of it (its gate or up ``half`` of ``gate_up_proj``)."""

    target: str
    expert: int | None = None
    half: int | None = None

    def copy_into(self, param: torch.Tensor, value: Weight) -> None:
        if isinstance(value, QuantizedWeight):
            value = value.dequantize(param.dtype)
        dest = param if self.expert is None else param[self.expert]
        if self.half is not None:
            dest = dest.narrow(0, self.half * (dest.shape[0] // 2), dest.shape[0] // 2)
        if dest.shape != value.shape:
            raise ValueError(f"{self.target}: got a weight of {list(value.shape)} for a slot "
                             f"of {list(dest.shape)}")
        with torch.no_grad():
            dest.copy_(value)


def expert_slot(name: str) -> ExpertSlot | None:
    """The slot of a per-expert weight, or of anything under Mixtral's ``block_sparse_moe``;
    None for every other name (the fused form's included: those are the model's names)."""
    if match := _PER_EXPERT.match(name):
        layer, expert, part = match.groups()
        stacked, half = _PARTS[part]
        return ExpertSlot(f"{layer}.mlp.experts.{stacked}", int(expert), half)
    if match := _MIXTRAL_BLOCK.match(name):
        layer, rest = match.groups()
        return ExpertSlot(f"{layer}.mlp.{rest}")
    return None


def checkpoint_layout(architecture: str,
                      weights: Iterable[tuple[str, Weight]]) -> Iterable[tuple[str, Weight]]:
    """The checkpoint's weights as the loader takes them: gpt-oss's rewritten by
    ``gpt_oss_layout``, every other architecture's as they are."""
    return gpt_oss_layout(weights) if architecture == GPT_OSS else weights


def gpt_oss_layout(weights: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
    """gpt-oss's router renamed ``mlp.gate``; its expert matrices transposed to ``[E, out,
    in]``, and the gate/up rows (and biases) put as a gate half then an up half."""
    for name, value in weights:
        match = _GPT_OSS_MLP.match(name)
        if match is None:
            yield name, value
            continue
        prefix, part = match.groups()
        if isinstance(value, QuantizedWeight):
            value = value.dequantize()
        if part.endswith("proj"):
            value = value.transpose(1, 2)
        if part.startswith("experts.gate_up_proj"):
            value = torch.cat([value[:, 0::2], value[:, 1::2]], dim=1)
        yield f"{prefix}.{part.replace('router.', 'gate.')}", value.contiguous()


# the fused form's stacked experts, or their biases (gpt-oss's)
_FUSED_EXPERTS = re.compile(r"^(?:model\.)?layers\.\d+\.mlp\.experts\."
                            r"(gate_up_proj|down_proj)(_bias)?$")


def shard_experts(name: str, value: Weight, intermediate: int, rank: int) -> Weight | None:
    """A tensor-parallel rank's part of an expert weight, every expert's intermediate split
    alike (``intermediate``: each rank's share, this rank's from ``rank * intermediate``): the
    gate and up rows, the down inputs; the down bias whole on rank 0 only (each rank's output
    is a partial sum, all-reduced). None for any other weight."""
    start = rank * intermediate
    if match := _PER_EXPERT.match(name):
        part = _PARTS[match.group(3)]
        if part[0] == "down_proj":
            return (value.narrow_cols(start, intermediate) if isinstance(value, QuantizedWeight)
                    else value.narrow(1, start, intermediate))
        return (value.narrow_rows(start, intermediate) if isinstance(value, QuantizedWeight)
                else value.narrow(0, start, intermediate))
    match = _FUSED_EXPERTS.match(name)
    if match is None:
        return None
    stacked, bias = match.groups()  # stacked experts are float (quantized ones come apart)
    if stacked == "down_proj":
        if bias:
            return value if rank == 0 else torch.zeros_like(value)
        return value.narrow(2, start, intermediate)
    gate, up = value.chunk(2, dim=1)  # [E, 2*I, H], or the bias's [E, 2*I]: gate half first
    return torch.cat([gate.narrow(1, start, intermediate), up.narrow(1, start, intermediate)],
                     dim=1)
