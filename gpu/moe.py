"""The mixture-of-experts feed-forward layer of Qwen3-MoE, Mixtral and gpt-oss.

A router (a linear of one output per expert) scores each token; the softmax of the scores, in
float32, picks the token's ``top_k`` experts, whose weights are renormalised to sum to one
where the model says so. Each expert is a gated MLP; the token's output is its experts'
outputs, weighted, summed. The experts' weights are stacked: ``gate_up_proj`` ``[E, 2*I, H]``
(gate rows first, then up) and ``down_proj`` ``[E, H, I]``, as transformers 5 holds them.

gpt-oss adds to this (``ExpertExtras``): a bias per expert on both projections, its own
activation over the ``[gate | up]`` rows (a clamped SwiGLU, ``layers.clamped_swiglu``), a
router with a bias, and its routing order: the top-k of the router's logits, then the softmax
over those k (``Routing.softmax_after_topk``). Its checkpoints' interleaved gate/up rows are
put in our order at load time (``gpu/models/gpt_oss.py``).

Four ways compute the same thing:

- ``moe_reference``: token by token, expert by expert; the one to read, and the tests' yardstick;
- ``moe_grouped``: the (token, expert) pairs sorted by expert, each expert's two GEMMs over
  its own rows only, the rows put back in token order and weighted. Each expert's weights are
  read once a step, however many tokens chose it; it reads the per-expert row counts on the
  host (a sync on a GPU, where the Triton path runs instead);
- ``moe_gathered``: each pair's expert weights gathered and multiplied in two batched
  matmuls, no sorting and no loop over experts; for steps with fewer pairs than experts (a
  few decode rows), where the loop's fixed costs outweigh the copy. Past that it is the
  grouped path;
- ``moe_triton``: on a GPU, the grouped computation in two Triton kernels with no host sync
  (``gpu/moe_triton.py``); not for experts with extras, which take the other paths.

On the CPU the choice between grouped and gathered is timed per row bucket like every other op
(``gpu/cpu/op_plans.py``); untimed, the grouped path runs.

Quantized experts (``--quantization``, ``gpu/quantization/experts.py``) are one quantized
linear per expert and projection: they take the grouped path on every device, each expert's
GEMMs over its own rows in the quantized-linear kernels (on a GPU the Triton quantized GEMM,
host-synced per step like any grouped step). On the CPU, where the kernels are built, the
block's ``block`` runs that path in C++ (``gpu/cpu/csrc/moe_block.cpp``: the same ops without
the Python loop over experts), and the one-call decode step calls the same object.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tidal.gpu import layers
from tidal.gpu.cpu.selector import Plan
from tidal.gpu.distributed import tensor_parallel
from tidal.gpu.layers import silu_and_mul

GROUPED, GATHERED = "grouped", "gathered"


@dataclass(frozen=True)
class Routing:
    """How a model routes: ``top_k`` experts a token, their weights renormalised to sum to one
    where ``renormalize``; ``float32_weights``: the weights multiply the experts' outputs in
    float32 (Mixtral, as HF runs it) rather than rounded to the model's dtype first (Qwen3)."""

    top_k: int
    renormalize: bool
    float32_weights: bool = False
    softmax_after_topk: bool = False  # gpt-oss: the softmax over the chosen k, in their dtype


Activation = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ExpertExtras:
    """What gpt-oss's experts add to the plain gated MLP: a bias per expert on each
    projection (``[E, 2*I]`` and ``[E, H]``), and an activation of the fused ``[gate | up]``
    rows other than ``silu_and_mul``."""

    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    activation: Activation = silu_and_mul


PLAIN = ExpertExtras()


def route(logits: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, expert ids)``, each ``[tokens, top_k]``, weights float32 (in the logits'
    dtype where ``softmax_after_topk``), from the router's ``[tokens, E]`` logits."""
    if routing.softmax_after_topk:
        top, ids = torch.topk(logits, routing.top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), ids
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, routing.top_k, dim=-1)
    if routing.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


ExpertWeight = torch.Tensor | Callable[[torch.Tensor], torch.Tensor]  # a matrix, or a layer


def expert_mlp(rows: torch.Tensor, gate_up: ExpertWeight, down: ExpertWeight,
               extras: ExpertExtras = PLAIN, expert: int = 0) -> torch.Tensor:
    """One expert's gated MLP over ``rows`` ``[n, H]`` (``expert`` picks its biases); each
    weight a float matrix or a quantized expert's linear (``QuantLinear``, no bias of its own)."""
    gate_up_bias, down_bias = _biases(extras, expert)
    hidden = extras.activation(_linear(rows, gate_up, gate_up_bias))
    return _linear(hidden, down, down_bias)


def _linear(rows: torch.Tensor, weight: ExpertWeight,
            bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(weight, torch.Tensor):
        return F.linear(rows, weight, bias)
    y = weight(rows)
    return y if bias is None else y + bias


def _biases(extras: ExpertExtras,
            expert: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    up, down = extras.gate_up_bias, extras.down_bias
    return (None if up is None else up[expert]), (None if down is None else down[expert])


def weighted_sum(outputs: torch.Tensor, weights: torch.Tensor, routing: Routing) -> torch.Tensor:
    """``[tokens, H]``: each token's ``[top_k, H]`` expert outputs weighted and summed."""
    dtype = outputs.dtype
    scale = weights if routing.float32_weights else weights.to(dtype)
    return (outputs * scale[..., None]).to(dtype).sum(dim=1)


def moe_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor, routing: Routing,
                  extras: ExpertExtras = PLAIN) -> torch.Tensor:
    """Token by token, expert by expert, in torch's own ops."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for weight, e in zip(weights[t], ids[t].tolist()):
            gate_up_bias, down_bias = _biases(extras, e)
            if extras is PLAIN:
                gate, up = F.linear(x[t], gate_up[e]).chunk(2)
                hidden = F.silu(gate) * up
            else:
                hidden = extras.activation(F.linear(x[t:t + 1], gate_up[e], gate_up_bias))[0]
            y = F.linear(hidden, down[e], down_bias)
            scale = weight if routing.float32_weights else weight.to(x.dtype)
            out[t] += (y * scale).to(x.dtype)
    return out


def moe_grouped(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                weights: torch.Tensor, ids: torch.Tensor, routing: Routing,
                extras: ExpertExtras = PLAIN) -> torch.Tensor:
    """The pairs sorted by expert, each expert's GEMMs over its own rows. ``gate_up`` and
    ``down``: the stacked matrices, or each expert's quantized linear (``QuantExperts``).
    A lone row (decode at concurrency 1, where quantized experts always come here) runs its
    experts in the order routing chose them, without the sort, the per-expert counts and the
    pass over every expert, which add a few torch calls and a Python loop to each layer."""
    tokens, top_k = ids.shape
    if tokens == 1:  # its top_k experts are distinct: no sort, no pass over every expert
        outputs = _lone_row(x, gate_up, down, ids[0].tolist(), extras)
        return weighted_sum(outputs.view(1, top_k, x.shape[1]), weights, routing)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pair i of the sorted rows is pair order[i]
    counts = torch.bincount(flat, minlength=len(gate_up)).tolist()
    rows = x[order // top_k]
    sorted_out = torch.empty(tokens * top_k, x.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            sorted_out[start:start + n] = expert_mlp(rows[start:start + n], gate_up[e], down[e],
                                                     extras, e)
            start += n
    outputs = torch.empty_like(sorted_out)
    outputs[order] = sorted_out
    return weighted_sum(outputs.view(tokens, top_k, x.shape[1]), weights, routing)


def _lone_row(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: list[int],
              extras: ExpertExtras) -> torch.Tensor:
    """A lone row's ``[top_k, H]`` expert outputs: quantized experts on the dot kernel in one
    call per projection (``quantization.experts.ExpertLinears``) where they all run it, else
    expert by expert."""
    if extras is PLAIN and _together(gate_up, ids) and _together(down, ids):
        return down.together(extras.activation(gate_up.together(x, ids)), ids)
    return torch.cat([expert_mlp(x, gate_up[e], down[e], extras, e) for e in ids])


def _together(weights: ExpertWeight | torch.Tensor, ids: list[int]) -> bool:
    on_dot = getattr(weights, "on_dot", None)
    return on_dot is not None and on_dot(ids)


def moe_gathered(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                 weights: torch.Tensor, ids: torch.Tensor, routing: Routing,
                 extras: ExpertExtras = PLAIN) -> torch.Tensor:
    """Each pair's expert weights gathered, two batched matmuls; the grouped path where
    there are more pairs than experts (the gathered copies would outweigh the weights), or
    the experts are quantized (nothing to gather)."""
    tokens, top_k = ids.shape
    if tokens * top_k > len(gate_up) or not isinstance(gate_up, torch.Tensor):
        return moe_grouped(x, gate_up, down, weights, ids, routing, extras)
    flat = ids.reshape(-1)
    rows = x.repeat_interleave(top_k, dim=0).unsqueeze(-1)  # [pairs, H, 1]
    gate_up_rows = torch.bmm(gate_up[flat], rows).squeeze(-1)
    if extras.gate_up_bias is not None:
        gate_up_rows = gate_up_rows + extras.gate_up_bias[flat]
    hidden = extras.activation(gate_up_rows)
    outputs = torch.bmm(down[flat], hidden.unsqueeze(-1)).squeeze(-1)
    if extras.down_bias is not None:
        outputs = outputs + extras.down_bias[flat]
    return weighted_sum(outputs.view(tokens, top_k, x.shape[1]), weights, routing)


def moe_triton(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
               weights: torch.Tensor, ids: torch.Tensor, routing: Routing,
               extras: ExpertExtras = PLAIN) -> torch.Tensor:
    """The grouped computation in the Triton kernels of ``gpu/moe_triton.py`` (plain experts
    only: ``MoE`` sends experts with extras elsewhere)."""
    assert extras is PLAIN, "the Triton MoE kernels have no expert biases or other activation"
    from tidal.gpu.moe_triton import fused_experts

    scales = weights if routing.float32_weights else weights.to(x.dtype)
    return fused_experts(x, gate_up, down, scales, ids).sum(dim=1)


def runs_on_triton(x: torch.Tensor) -> bool:
    """Whether ``x`` goes to the Triton path: on a GPU (unless ``TIDAL_GPU_KERNELS=off``),
    or on the CPU in Triton's interpreter where tests ask (``layers.TRITON_ON_CPU``)."""
    on_device = x.device.type == "cuda" or (layers.TRITON_ON_CPU and x.device.type == "cpu")
    return on_device and layers.GPU_KERNELS and _triton_importable()


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


MoePath = Callable[..., torch.Tensor]  # (x, gate_up, down, weights, ids, routing, extras)
PATHS: dict[str, MoePath] = {GROUPED: moe_grouped, GATHERED: moe_gathered}


class Experts(nn.Module):
    """The experts' stacked weights (names as transformers 5's ``experts`` module), and with
    ``bias`` their biases (gpt-oss's names)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int,
                 bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.gate_up_proj_bias = (nn.Parameter(torch.empty(num_experts, 2 * intermediate))
                                  if bias else None)
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden)) if bias else None


class MoE(nn.Module):
    """A sparse MoE block: the router ``gate`` and the ``experts``, run by the Triton path on
    a GPU, on the CPU by the path its ``plan`` names for the step's row count (the grouped one
    without a plan). ``bias``: the router and the experts have biases; ``activation``: the
    experts' own, over the fused ``[gate | up]`` rows (gpt-oss's)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, routing: Routing,
                 bias: bool = False, activation: Activation = silu_and_mul) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, num_experts, bias=bias)
        self.experts = Experts(num_experts, hidden, intermediate, bias)
        self.routing = routing
        self.activation = activation
        self.plan: Plan | None = None
        self.block: object | None = None  # the C++ block of quantized experts (experts.py)
        self.tp = tensor_parallel()  # each rank holds a slice of every expert's intermediate

    def extras(self) -> ExpertExtras:
        if self.experts.gate_up_proj_bias is None and self.activation is silu_and_mul:
            return PLAIN
        return ExpertExtras(self.experts.gate_up_proj_bias, self.experts.down_proj_bias,
                            self.activation)

    @property
    def quantized(self) -> bool:
        """Whether the experts are quantized (``gpu/quantization/experts.py``): each expert's
        two linears then run on the grouped path, on any device."""
        return not isinstance(self.experts, Experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output; under tensor parallelism each rank's partial sum, all-reduced."""
        if runs_on_triton(x) and self.extras() is PLAIN and not self.quantized:
            return self.tp.all_reduce(self.run(x, moe_triton))
        if self.block is not None and x.device.type == "cpu":
            return self.tp.all_reduce(self.block(x))
        choice = (self.plan.pick(x.shape[0]) if self.plan is not None and not self.quantized
                  else GROUPED)
        return self.tp.all_reduce(self.run(x, PATHS[choice]))

    def run(self, x: torch.Tensor, path: MoePath) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.routing)
        return path(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids,
                    self.routing, self.extras())

    def plan_key(self) -> str:
        """What the timed plan depends on: the experts' count, shapes and dtype."""
        e, two_i, h = self.experts.gate_up_proj.shape
        dtype = str(self.experts.gate_up_proj.dtype).removeprefix("torch.")
        return f"moe|{e}e top{self.routing.top_k}|{h}x{two_i // 2}|{dtype}"

    def candidates(self, rows: int) -> dict[str, Callable[[], object]]:
        """The paths over ``rows`` random tokens, on this layer's own weights (a model's
        experts are too large to copy for timing)."""
        x = torch.randn(rows, self.gate.in_features).to(self.experts.gate_up_proj)
        return {name: (lambda p=path: self.run(x, p)) for name, path in PATHS.items()}

