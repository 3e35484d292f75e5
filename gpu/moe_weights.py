"""Where a checkpoint's expert weights go in a MoE model's stacked parameters (``gpu/moe.py``).

Checkpoints hold experts in one of two forms, and both load:

- fused, as transformers 5 holds them in memory: ``mlp.experts.gate_up_proj`` ``[E, 2*I, H]``
  and ``mlp.experts.down_proj`` ``[E, H, I]``, the model's own names (no mapping needed);
- per expert, as published checkpoints are: Qwen3-MoE's
  ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`` and Mixtral's
  ``block_sparse_moe.experts.{e}.w1/w3/w2.weight`` (gate, up, down), each into its expert's
  slice of the stacked parameter. Mixtral's router, ``block_sparse_moe.gate``, is ``mlp.gate``.

Quantized expert weights (a GGUF's, a quantized checkpoint's) are dequantized: experts are kept
in the model's dtype (``--quantization`` leaves them so too, ``gpu/quantization/apply.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from tidal.gpu.quantization.weights import QuantizedWeight, Weight

_PER_EXPERT = re.compile(r"^(?:model\.)?(layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\."
                         r"(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_MIXTRAL_BLOCK = re.compile(r"^(?:model\.)?(layers\.\d+)\.block_sparse_moe\.(.+)$")
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
