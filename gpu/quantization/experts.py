"""Quantized experts of a MoE block (``--quantization int8|int4``, ``gpu/moe.py``).

Each expert's gate/up and down matrices are quantized like any dense linear's (``weights.py``,
row by row, so each expert's ``[2*I, H]`` gate/up is its gate and up halves quantized apart and
stacked) and held as that expert's own ``QuantLinear`` (``linear.py``): the grouped MoE path
runs each expert's two GEMMs over its own tokens' rows through the quantized-linear kernels,
planned per shape like the dense linears. The float experts are never allocated: the model is
built with them empty, and each expert's weights are quantized as they are read
(``quantize_experts_on_read``) and collected (``ExpertCollector``): on the CPU each layer's
experts are planned and packed as soon as they are all read, so the load never holds more than
a layer of them unpacked (one value a byte, float32 scales), nor a layer of float weights.

Expert biases (gpt-oss's) stay in the model's dtype, added after each expert's GEMM.

On the CPU a block whose router and experts all have their C++ ``PlannedLinear`` is given its
C++ form (``compile_blocks``, ``gpu/cpu/csrc/moe_block.cpp``), which runs the grouped path
without a Python loop over the experts, gpt-oss's biases, clamped SwiGLU and routing included.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from tidal.gpu.checkpoints.mapped_pages import MappedPages
from tidal.gpu.cpu.host_allocator import release_freed_host_memory
from tidal.gpu.cpu.kernels import load_cpu_kernels
from tidal.gpu.layers import ClampedSwiGLU, silu_and_mul
from tidal.gpu.moe import MoE
from tidal.gpu.moe_weights import ExpertSlot
from tidal.gpu.quantization.linear import DOT, QuantLinear
from tidal.gpu.quantization.planner import QuantPlanner
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
        self.gate_up_proj = ExpertLinears(gate_up)
        self.down_proj = ExpertLinears(down)
        self.gate_up_proj_bias = gate_up_bias
        self.down_proj_bias = down_bias


class ExpertLinears(nn.ModuleList):
    """One projection's experts, a ``QuantLinear`` each (``gate_up_proj[e]``). For a lone
    decode row, the experts it chose can run in one call of the dot kernel
    (``dot_linear_experts``): what a call per expert gives, bit for bit, without starting and
    ending a parallel region per expert."""

    def on_dot(self, ids: list[int]) -> bool:
        """Whether experts ``ids`` all run the dot kernel at one row (``together`` takes them)."""
        return all(_dot_at_one_row(self[e]) for e in ids)

    def together(self, x: torch.Tensor, ids: list[int]) -> torch.Tensor:
        """``[len(ids), out]``: expert ``ids[i]`` over row ``i`` of ``x`` (or over its one row)."""
        layers = [self[e] for e in ids]
        first = layers[0]
        return first.packs.kernels.dot_linear_experts(
            x, [layer.packs.dot[0] for layer in layers],
            [layer.packs.dot[1] for layer in layers], first.bits, first.group_size,
            first.out_features)


def _dot_at_one_row(layer: QuantLinear) -> bool:
    return (layer.packs is not None and layer.packs.dot is not None
            and layer.plan.pick(1) == DOT)


def compile_blocks(model: nn.Module) -> None:
    """Set each MoE block's ``block``: its C++ form where it applies (``_compiled``), else None."""
    for moe in model.modules():
        if isinstance(moe, MoE):
            moe.block = _compiled(moe)


def _compiled(moe: MoE) -> object | None:
    """The C++ ``MoeBlock`` of a block of quantized experts whose router and experts all have a
    ``PlannedLinear`` and whose activation it has (SiLU, or gpt-oss's ``ClampedSwiGLU``)."""
    experts, kernels, act = moe.experts, load_cpu_kernels(), moe.activation
    if (kernels is None or not isinstance(experts, QuantExperts)
            or not (act is silu_and_mul or isinstance(act, ClampedSwiGLU) and act.limit > 0)):
        return None
    gate_up = [layer.kernel for layer in experts.gate_up_proj]
    down = [layer.kernel for layer in experts.down_proj]
    router = getattr(moe.gate, "kernel", None)
    if router is None or any(k is None for k in [*gate_up, *down]):
        return None
    routing, swiglu = moe.routing, act if isinstance(act, ClampedSwiGLU) else None
    return kernels.MoeBlock(
        router, gate_up, down, routing.top_k, routing.renormalize, routing.float32_weights,
        _detached(experts.gate_up_proj_bias), _detached(experts.down_proj_bias),
        swiglu.limit if swiglu else 0.0, swiglu.alpha if swiglu else 1.702,
        routing.softmax_after_topk)


def _detached(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.detach()


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
    """Each expert's matrices quantized, and its pages of a mapped checkpoint let go once
    read: the stacked tensor is a whole layer's experts (800 MB of Qwen3-30B-A3B's)."""
    pages = MappedPages()
    for e, matrix in enumerate(value):
        if part == "down_proj":
            yield f"{prefix}.{e}.down_proj.weight", quantize(matrix, method, group_size)
        else:
            gate, up = matrix.chunk(2)
            yield f"{prefix}.{e}.gate_proj.weight", quantize(gate, method, group_size)
            yield f"{prefix}.{e}.up_proj.weight", quantize(up, method, group_size)
        pages.let_go(matrix)


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
    to (``layers.0.mlp.experts.gate_up_proj``), by (expert, gate or up half). With a
    ``planner``, a stacked parameter's experts are made ``QuantLinear`` layers and packed for
    their plans as soon as all of them are read, so a load holds one layer's unpacked values
    at a time, not the whole model's. Each expert borrows the packed layouts of its
    counterpart in ``lender`` (the model serving while this one is prepared, read from the
    same checkpoint), so the two models hold one copy of the experts, not two."""

    model: nn.Module
    dtype: torch.dtype
    planner: QuantPlanner | None = None
    lender: nn.Module | None = None
    parts: dict[str, dict[tuple[int, int | None], QuantizedWeight]] = field(default_factory=dict)
    built: dict[str, list[QuantLinear]] = field(default_factory=dict)

    def take(self, slot: ExpertSlot, value: QuantizedWeight) -> None:
        if slot.expert is None:
            raise ValueError(f"{slot.target}: quantized experts arrive one expert at a time")
        parts = self.parts.setdefault(slot.target, {})
        parts[(slot.expert, slot.half)] = value
        if self.planner is not None and _complete(self.model, slot.target, parts):
            self.built[slot.target] = self._build(slot.target)
            release_freed_host_memory()  # the layer's temporaries, kept by the thresholds

    def install(self) -> None:
        """Replace each MoE block's ``Experts`` whose weights were collected with
        ``QuantExperts`` over them (its biases kept)."""
        for path in sorted({_block(target) for target in [*self.parts, *self.built]}):
            moe = self.model.get_submodule(path)
            gate_up = self._linears(f"{path}.experts.gate_up_proj")
            down = self._linears(f"{path}.experts.down_proj")
            old = moe.experts
            moe.experts = QuantExperts(gate_up, down, old.gate_up_proj_bias, old.down_proj_bias)

    def _linears(self, target: str) -> list[QuantLinear]:
        built = self.built.pop(target, None)
        return built if built is not None else self._build(target)

    def _build(self, target: str) -> list[QuantLinear]:
        """``target``'s experts as ``QuantLinear`` layers (planned and packed with a
        ``planner``); their parts are let go."""
        parts = self.parts.pop(target, {})
        want = _wanted(self.model, target)
        if set(parts) != want:
            raise ValueError(f"quantized {target} is missing experts' weights: "
                             f"{sorted(want - set(parts), key=str)[:4]}")
        halves = _halves(target)
        layers = []
        for e in range(len(want) // len(halves)):  # gate rows, then up (cat_rows of one: itself)
            layer = QuantLinear(cat_rows([parts.pop((e, h)) for h in halves]), None, self.dtype)
            layer.borrow(counterpart(self.lender, f"{target}.{e}"))
            if self.planner is not None:
                self.planner.plan(layer)
            layers.append(layer)
        _check_shapes(target, layers, self.model.get_submodule(_block(target)).gate.in_features)
        return layers


def counterpart(model: nn.Module | None, path: str) -> nn.Module | None:
    """``model``'s module at ``path`` (``layers.0.mlp.experts.gate_up_proj.3``), if it has one."""
    if model is None:
        return None
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _block(target: str) -> str:
    return target.rsplit(".", 2)[0]


def _halves(target: str) -> tuple[int | None, ...]:
    return (0, 1) if target.endswith("gate_up_proj") else (None,)


def _complete(model: nn.Module, target: str, parts: dict) -> bool:
    experts = model.get_submodule(_block(target)).gate.out_features
    return len(parts) == experts * len(_halves(target)) and set(parts) == _wanted(model, target)


def _wanted(model: nn.Module, target: str) -> set[tuple[int, int | None]]:
    """The (expert, half) parts that make ``target`` whole."""
    experts = model.get_submodule(_block(target)).gate.out_features
    return {(e, h) for e in range(experts) for h in _halves(target)}


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
