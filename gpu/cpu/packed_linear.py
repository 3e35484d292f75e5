"""Linear layers whose weights are packed once at load time, for inference on the CPU.

``F.linear`` on the CPU hands every call to a BLAS that re-packs the weight into its blocked
layout each time, which at decode batch sizes costs about as much as the multiply. There are
four ways to multiply by a weight packed once, and which is fastest depends on the CPU and the
row count, so the selector (``gpu/cpu/selector.py``) times them for each weight shape and row
bucket on this host, and each layer keeps only the layouts its plan uses:

- ``panels``: tidal's own float32 GEMM (``csrc/linear.cpp``), which prefetches the next panel
  of the weight while it multiplies this one;
- ``mkl``: MKL's packed sgemm (``csrc/mkl_linear.cpp``), where torch has MKL;
- ``onednn``: oneDNN's packed linear, as torch's ``mkldnn`` ops make it (float32 and bfloat16);
- ``torch``: ``F.linear`` over the plain weight, torch's own path, always a candidate.

All give ordinary IEEE float results (no reduced-precision maths): they differ from
``F.linear`` only in summation order and fused multiply-adds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from tidal.gpu.cpu import selector
from tidal.gpu.cpu.kernels import load_cpu_kernels
from tidal.gpu.cpu.selector import TORCH, Plan, PlanCache

logger = logging.getLogger(__name__)

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
METHODS = ("panels", "mkl", "onednn", TORCH)  # index = csrc's LinearMethod
# The most float32 linear-weight bytes that may be kept in two layouts (about 250M
# parameters); a larger model keeps each weight in the one layout that loses least overall.
TWO_LAYOUTS_MAX_BYTES = 1 << 30
# Weights are timed with at most this many output features: the cost of every candidate grows
# in proportion past it, and a vocabulary-wide output head would take seconds a bucket.
TIMED_MAX_OUT_FEATURES = 8192


def onednn_available(dtype: torch.dtype) -> bool:
    """oneDNN's packed linear, where torch has oneDNN; bfloat16 only where oneDNN has a
    bfloat16 path (AVX-512 or AVX-NE-CONVERT), which is slower than torch's without."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def candidate_methods(dtype: torch.dtype, kernels: ModuleType | None) -> list[str]:
    """The methods that can run a weight of ``dtype`` here."""
    methods = []
    if kernels is not None and dtype == torch.float32:
        methods.append("panels")
        if kernels.mkl_pack_linear_weight(torch.zeros(1, 1)) is not None:
            methods.append("mkl")
    if onednn_available(dtype):
        methods.append("onednn")
    return methods + [TORCH]


class LinearPacks:
    """A weight in the layouts that ``methods`` name (``None`` for the others)."""

    def __init__(self, weight: torch.Tensor, methods: set[str],
                 kernels: ModuleType | None) -> None:
        weight = weight.detach()
        self.panels = kernels.pack_linear_weight(weight) if "panels" in methods else None
        # MKL's pack keeps metadata tied to its address: a buffer never to be copied or moved.
        self.mkl = kernels.mkl_pack_linear_weight(weight) if "mkl" in methods else None
        self.onednn = (torch.ops.mkldnn._reorder_linear_weight(weight)
                       if "onednn" in methods else None)
        self.plain = weight.contiguous() if TORCH in methods else None

    def run(self, method: str, x: torch.Tensor, out_features: int, bias: torch.Tensor | None,
            kernels: ModuleType | None) -> torch.Tensor:
        """``x W^T + b`` by ``method``, from Python (for timing, and where no kernels exist)."""
        if method == "panels":
            return kernels.packed_linear(x, self.panels, out_features, bias)
        if method == "mkl":
            return kernels.mkl_linear(x, self.mkl, out_features, bias)
        if method == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn, bias, "none", [None], "")
        return F.linear(x, self.plain, bias)


class PackedLinear(nn.Module):
    """``y = x W^T + b`` by the method its plan names for the row count, over the packed
    copies of ``W`` that plan uses. The plain weight is dropped with the ``nn.Linear`` unless
    the plan runs torch's path (a tied output head's stays, as the input embedding). Packed
    bytes are opaque: convert the model's dtype before packing, never after."""

    def __init__(self, linear: nn.Linear, plan: Plan | None = None) -> None:
        """``plan``: by default, tidal's GEMM where the kernels are built, else oneDNN, else
        torch (the ``force`` mode's choice)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        kernels = load_cpu_kernels() if selector.mode() != "off" else None
        self.plan = plan or Plan.always(candidate_methods(weight.dtype, kernels)[0])
        packs = LinearPacks(weight, self.plan.used(), kernels)
        # Buffers, so .to() and state_dict see them; none is ever moved (MKL's pack can't be).
        for name in ("panels", "mkl", "onednn", "plain"):
            self.register_buffer(f"{name}_weight", getattr(packs, name), persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().contiguous()
        self.register_buffer("bias", bias, persistent=False)
        self.packs = packs
        self.kernel = None  # the C++ PlannedLinear, which decoder.cpp's steps call too
        if kernels is not None:
            self.kernel = kernels.PlannedLinear(
                self.out_features, bias, packs.panels, packs.mkl, packs.onednn, packs.plain,
                [METHODS.index(m) for m in self.plan.by_rows()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()  # the kernels read each row as one run of floats
        if self.kernel is not None:
            y = self.kernel(rows)
        else:
            y = self.packs.run(self.plan.pick(rows.shape[0]), rows, self.out_features,
                               self.bias, None)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{self.plan.describe()}")


def can_pack(device: str | torch.device, dtype: torch.dtype) -> bool:
    """A CPU and a dtype some packed method takes (float32, or bfloat16)."""
    return torch.device(device).type == "cpu" and dtype in PACKABLE_DTYPES


def linear_candidates(out_features: int, in_features: int, dtype: torch.dtype, bias: bool,
                      methods: list[str], kernels: ModuleType | None
                      ) -> Callable[[int], dict[str, Callable[[], object]]]:
    """For the selector: each method's call on ``rows`` random rows, over a random weight of
    this shape (capped at ``TIMED_MAX_OUT_FEATURES`` outputs) packed once per method."""
    n = min(out_features, TIMED_MAX_OUT_FEATURES)
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(n, in_features, generator=gen) * in_features ** -0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    packs = LinearPacks(weight, set(methods), kernels)

    def candidates(rows: int) -> dict[str, Callable[[], object]]:
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        return {m: (lambda m=m: packs.run(m, x, n, b, kernels)) for m in methods}

    return candidates


def plan_linears(linears: list[nn.Linear], max_rows: int, cache: PlanCache | None
                 ) -> list[Plan]:
    """A plan per layer, by timing each distinct (shape, dtype, bias) once (``auto``), or the
    default method (``force``, ``off``, or no ``cache``)."""
    kernels = load_cpu_kernels() if selector.mode() != "off" else None
    timed = selector.mode() != "force" and cache is not None
    buckets = selector.row_buckets(max_rows)
    plans: dict[tuple, Plan] = {}
    for linear in linears:
        key = (linear.out_features, linear.in_features, linear.weight.dtype,
               linear.bias is not None)
        if key in plans:
            continue
        methods = candidate_methods(linear.weight.dtype, kernels)
        if not timed:
            plans[key] = Plan.always(methods[0])
            continue
        name = "linear|{}x{}|{}|{}|{}".format(key[0], key[1],
                                              str(key[2]).removeprefix("torch."),
                                              "bias" if key[3] else "nobias", ",".join(methods))
        plans[key] = cache.get_or_choose(name, buckets,
                                         linear_candidates(*key, methods, kernels))
    return [plans[(m.out_features, m.in_features, m.weight.dtype, m.bias is not None)]
            for m in linears]


def pack_linear_layers(model: nn.Module, max_rows: int = 256, cache: PlanCache | None = None,
                       two_layouts_max_bytes: int = TWO_LAYOUTS_MAX_BYTES) -> list[PackedLinear]:
    """Swap every ``nn.Linear`` of ``model`` for a ``PackedLinear`` following its plan (timed
    up to ``max_rows`` rows with ``cache``). A model whose linears hold more than
    ``two_layouts_max_bytes`` keeps each weight in one layout."""
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    plans = plan_linears([child for _, _, child in swaps], max_rows, cache)
    if sum(child.weight.nbytes for _, _, child in swaps) > two_layouts_max_bytes:
        plans = [p if len(p.used()) == 1 else Plan.always(p.single()) for p in plans]
    packed = []
    for (parent, name, child), plan in zip(swaps, plans):
        layer = PackedLinear(child, plan)
        setattr(parent, name, layer)
        packed.append(layer)
    return packed
