"""The linear layer of a quantized weight: ``y = x W^T + b`` with ``W`` kept quantized.

Which implementation multiplies depends on the format, the device and the row count, so on the
CPU the selector (``gpu/cpu/selector.py``) times the candidates for each weight shape and row
bucket, as it does for float linears:

- ``aten``: torch's own fused ops, which dequantize inside the GEMM: ``_weight_int8pack_mm``
  (int8 with one scale per output channel) and ``_weight_int4pack_mm_for_cpu`` (int4 in groups
  of 32 to 256 with a scale and a zero point);
- ``torch``: the weight dequantized to the activations' dtype for the call and ``F.linear``
  over it. Always a candidate, and the reference the others are tested against; it never
  keeps a float copy of the weight between calls.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gpu.cpu import selector
from gpu.cpu.selector import TORCH, Plan, PlanCache
from gpu.quantization.weights import QuantizedWeight

ATEN = "aten"
METHODS = (ATEN, TORCH)  # in the order ``force`` prefers them
ATEN_INT4_GROUPS = (32, 64, 128, 256)
# Weights are timed with at most this many output features (the time grows in proportion).
TIMED_MAX_OUT_FEATURES = 8192


def candidate_methods(weight: QuantizedWeight, device: torch.device) -> list[str]:
    """The methods that can multiply by ``weight`` on ``device``."""
    methods = []
    if device.type == "cpu" and _aten_fits(weight):
        methods.append(ATEN)
    return methods + [TORCH]


def _aten_fits(w: QuantizedWeight) -> bool:
    if w.bits == 8:
        return w.per_channel and w.offsets is None
    return w.group_size in ATEN_INT4_GROUPS and w.offsets is not None


class QuantPacks:
    """A quantized weight in the layouts that ``methods`` name, for activations of ``dtype``."""

    def __init__(self, weight: QuantizedWeight, methods: set[str], dtype: torch.dtype) -> None:
        self.format = weight
        self.aten = _aten_pack(weight, dtype) if ATEN in methods else None

    def run(self, method: str, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if method == ATEN:
            y = self.aten(x)
            return y if bias is None else y + bias
        return F.linear(x, self.format.dequantize(x.dtype), bias)


def _aten_pack(w: QuantizedWeight, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    if w.bits == 8:
        q, scales = w.q.contiguous(), w.scales.view(-1).to(dtype).contiguous()
        return lambda x: torch.ops.aten._weight_int8pack_mm(x, q, scales)
    # torch's int4 format dequantizes as (q - 8) * scale + zero, zeros [groups, out, 2]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.q.to(torch.int32), 1)
    zeros = w.offsets + 8 * w.scales
    sz = torch.stack([w.scales, zeros], dim=-1).transpose(0, 1).to(dtype).contiguous()
    group = w.group_size
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz)


class QuantLinear(nn.Module):
    """A linear layer over a ``QuantizedWeight``, run by the method its plan names for the row
    count. Only the layouts the plan uses are kept."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32, plan: Plan | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bits, self.group_size = weight.bits, weight.group_size
        self.dtype = dtype
        # The weight's own form, until a plan packs it (``replan``); kept after only where the
        # plan runs torch's path, which dequantizes from it.
        self.weight_format: QuantizedWeight | None = weight
        self.plan = plan or Plan.always(candidate_methods(weight, weight.q.device)[0])
        self.packs = QuantPacks(weight, self.plan.used(), dtype)
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype),
                             persistent=False)
        self.kernel = None  # no C++ PlannedLinear: the one-call decode step does not take it

    @property
    def format_name(self) -> str:
        per_channel = self.group_size == self.in_features
        return f"int{self.bits}" + ("" if per_channel else f"g{self.group_size}")

    def replan(self, plan: Plan) -> None:
        """Pack for ``plan`` and keep only the layouts it uses."""
        if self.weight_format is None:
            raise RuntimeError("this layer was planned already: its weight's own form is gone")
        self.plan = plan
        self.packs = QuantPacks(self.weight_format, plan.used(), self.dtype)
        if TORCH not in plan.used():
            self.packs.format = self.weight_format = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        y = self.packs.run(self.plan.pick(rows.shape[0]), rows, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{self.format_name}, {self.plan.describe()}")


def quant_candidates(weight: QuantizedWeight, dtype: torch.dtype, methods: list[str]
                     ) -> Callable[[int], dict[str, Callable[[], object]]]:
    """For the selector: each method's call on ``rows`` random rows, over a random weight of
    ``weight``'s format (capped at ``TIMED_MAX_OUT_FEATURES`` outputs)."""
    n = min(weight.shape[0], TIMED_MAX_OUT_FEATURES)
    sample = weight.narrow_rows(0, n)
    packs = QuantPacks(sample, set(methods), dtype)
    gen = torch.Generator().manual_seed(0)

    def candidates(rows: int) -> dict[str, Callable[[], object]]:
        x = torch.randn(rows, weight.shape[1], generator=gen).to(dtype)
        return {m: (lambda m=m: packs.run(m, x, None)) for m in methods}

    return candidates


def plan_quant_linears(model: nn.Module, max_rows: int, cache: PlanCache | None) -> dict[str, Plan]:
    """Time each distinct quantized (shape, format, dtype) once (``auto`` with a ``cache``) and
    give every ``QuantLinear`` of ``model`` its plan; ``force`` and ``off`` keep the first
    candidate. Returns the plans by name, for the start-up table."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    timed = selector.mode() == "auto" and cache is not None
    buckets = selector.row_buckets(max_rows)
    plans: dict[str, Plan] = {}
    for layer in layers:
        w = layer.weight_format
        if w is None:
            continue  # planned already
        methods = candidate_methods(w, w.q.device)
        name = "qlinear {}x{} {}|{}|{}".format(
            layer.out_features, layer.in_features, layer.format_name,
            str(layer.dtype).removeprefix("torch."), ",".join(methods))
        if name not in plans:
            plans[name] = (cache.get_or_choose(name, buckets,
                                               quant_candidates(w, layer.dtype, methods))
                           if timed and len(methods) > 1 else Plan.always(methods[0]))
        layer.replan(plans[name])
    return plans
