"""Quantized experts of a MoE block (``--quantization int8|int4``, ``gpu/moe.py``).

Each expert's gate/up and down matrices are quantized like any dense linear's (``weights.py``,
row by row, so each expert's ``[2*I, H]`` gate/up is its gate and up halves quantized apart and
stacked) and held as that expert's own ``QuantLinear`` (``linear.py``): the grouped MoE path
runs each expert's two GEMMs over its own tokens' rows through the quantized-linear kernels,
planned per shape like the dense linears. The float experts are never allocated: the model is
built with them empty, and each expert's weights are quantized as they are read
(``quantize_experts_on_read``) and collected until the model is read (``ExpertCollector``).

Expert biases (gpt-oss's) stay in the model's dtype, added after each expert's GEMM.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from tidal.gpu.moe import MoE
from tidal.gpu.moe_weights import ExpertSlot
from tidal.gpu.quantization.linear import QuantLinear
from tidal.gpu.quantization.weights import QuantizedWeight, Weight, cat_rows, quantize

# the fused form's stacked experts (transformers 5's names; gpt-oss's once in our layout)
_FUSED = re.compile(r"^((?:model\.)?layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


class QuantExperts(nn.Module):
    """A MoE block's experts as one ``QuantLinear`` per expert and projection, under the
    stacked parameters' names (``gate_up_proj[e]``, ``down_proj[e]``), with the biases of
    ``Experts`` where it has them."""

    def __init__(self, gate_up: list[QuantLinear], down: list[QuantLinear],
                 gate_up_bias: torch.Tensor | None = None,
                 down_bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.gate_up_proj = nn.ModuleList(gate_up)
        self.down_proj = nn.ModuleList(down)
        self.gate_up_proj_bias = gate_up_bias
        self.down_proj_bias = down_bias


def quantize_experts_on_read(name: str, value: Weight, method: str, group_size: int
                             ) -> Iterator[tuple[str, Weight]] | None:
    """A fused-form checkpoint's stacked experts (``[E, out, in]``) as each expert's gate, up
    and down weights quantized, under the per-expert names the loader places
    (``moe_weights.expert_slot``); None for any other weight."""
    match = _FUSED.match(name)
    if match is None or not isinstance(value, torch.Tensor) or value.dim() != 3:
        return None
    prefix, part = match.groups()
    return _per_expert(prefix, part, value, method, group_size)


def _per_expert(prefix: str, part: str, value: torch.Tensor, method: str, group_size: int
                ) -> Iterator[tuple[str, Weight]]:
    for e, matrix in enumerate(value):
        if part == "down_proj":
            yield f"{prefix}.{e}.down_proj.weight", quantize(matrix, method, group_size)
            continue
        gate, up = matrix.chunk(2)
        yield f"{prefix}.{e}.gate_proj.weight", quantize(gate, method, group_size)
        yield f"{prefix}.{e}.up_proj.weight", quantize(up, method, group_size)


def leave_experts_unallocated(model: nn.Module) -> None:
    """Give the experts of a model still on the meta device empty weights, so that allocating
    the model leaves them out: their quantized weights replace them as read."""
    for moe in model.modules():
        if isinstance(moe, MoE):
            moe.experts.gate_up_proj = nn.Parameter(torch.empty(0, device="meta"))
            moe.experts.down_proj = nn.Parameter(torch.empty(0, device="meta"))


@dataclass
class ExpertCollector:
    """Quantized expert weights as the loader reads them: by the stacked parameter they belong
    to (``layers.0.mlp.experts.gate_up_proj``), by (expert, gate or up half)."""

    parts: dict[str, dict[tuple[int, int | None], QuantizedWeight]] = field(default_factory=dict)

    def take(self, slot: ExpertSlot, value: QuantizedWeight) -> None:
        if slot.expert is None:
            raise ValueError(f"{slot.target}: quantized experts arrive one expert at a time")
        self.parts.setdefault(slot.target, {})[(slot.expert, slot.half)] = value

    def install(self, model: nn.Module, dtype: torch.dtype) -> None:
        """Replace each MoE block's ``Experts`` whose weights were collected with
        ``QuantExperts`` over them (its biases kept)."""
        blocks = {target.rsplit(".", 2)[0] for target in self.parts}
        for path in sorted(blocks):
            moe = model.get_submodule(path)
            gate_up = self._linears(f"{path}.experts.gate_up_proj", moe, (0, 1), dtype)
            down = self._linears(f"{path}.experts.down_proj", moe, (None,), dtype)
            old = moe.experts
            moe.experts = QuantExperts(gate_up, down, old.gate_up_proj_bias, old.down_proj_bias)

    def _linears(self, target: str, moe: MoE, halves: tuple[int | None, ...],
                 dtype: torch.dtype) -> list[QuantLinear]:
        parts = self.parts.get(target, {})
        experts = moe.gate.out_features
        want = {(e, h) for e in range(experts) for h in halves}
        if set(parts) != want:
            raise ValueError(f"quantized {target} is missing experts' weights: "
                             f"{sorted(want - set(parts), key=str)[:4]}")
        layers = [QuantLinear(cat_rows([parts[(e, h)] for h in halves]), None, dtype)
                  for e in range(experts)]  # gate rows, then up (cat_rows of one: itself)
        _check_shapes(target, layers, moe.gate.in_features)
        return layers


def _check_shapes(target: str, layers: list[QuantLinear], hidden: int) -> None:
    gate_up = target.endswith("gate_up_proj")
    for layer in layers:
        if (layer.in_features if gate_up else layer.out_features) != hidden:
            raise ValueError(f"quantized {target}: an expert of {layer.out_features}x"
                             f"{layer.in_features} in a model of hidden size {hidden}")


def expert_bytes(moe: MoE) -> int:
    """The bytes a MoE block's experts hold: their parameters and, quantized, their weights in
    every form kept (the weight's own form and each packed layout)."""
    tensors = {id(t): t for t in moe.experts.parameters()}
    for layer in moe.experts.modules():
        if isinstance(layer, QuantLinear):
            forms = [layer.weight_format]
            if layer.packs is not None:
                forms += [layer.packs.tidal, layer.packs.aten, layer.packs.dot,
                          layer.packs.triton]
            for form in forms:
                for t in _tensors(form):
                    tensors[id(t)] = t
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _tensors(form: object) -> list[torch.Tensor]:
    """The tensors of a weight's form: a tensor, a tuple of them (the C++ and aten layouts),
    or a dataclass holding them (``QuantizedWeight``, the Triton layout)."""
    if form is None:
        return []
    if isinstance(form, torch.Tensor):
        return [form]
    if isinstance(form, (tuple, list)):
        return [t for f in form for t in _tensors(f)]
    return [v for v in vars(form).values() if isinstance(v, torch.Tensor)]
