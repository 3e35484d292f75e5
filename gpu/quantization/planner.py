"""Plans for quantized linears: each distinct (shape, format, dtype) timed once on this host
(``gpu/cpu/selector.py``), every ``QuantLinear`` of that kind given the plan and packed for it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch import nn

from tidal.gpu.cpu import selector
from tidal.gpu.cpu.packed_linear import TWO_LAYOUTS_MAX_BYTES
from tidal.gpu.cpu.selector import Plan, PlanCache, Timer, host_timer
from tidal.gpu.quantization.linear import (
    TIMED_MAX_OUT_FEATURES,
    QuantLinear,
    QuantPacks,
    candidate_methods,
)
from tidal.gpu.quantization.weights import QuantizedWeight

Candidates = Callable[[int], dict[str, Callable[[], object]]]  # rows -> each method's call
PROBE_CALLS = 2  # calls a candidate's time is the best of in a ``probe`` (the first warms)
PROBE_MAX_ROWS = 256  # a probe's buckets stop here: a call of thousands of rows takes seconds


def quant_candidates(weight: QuantizedWeight, dtype: torch.dtype, methods: list[str]
                     ) -> Candidates:
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


def untimed_plan(name: str, methods: list[str], buckets: list[int], hints: PlanCache | None,
                 candidates: Callable[[], Candidates] | None = None) -> Plan:
    """The plan of quantized linear ``name`` in a model loaded untimed: the first candidate,
    or under ``auto`` with ``hints`` (this host's plans) what this host measured: the cached
    plan of that name where it has one, else the choice its cached plans of the same format,
    dtype and candidates make most often, else a ``probe`` of ``candidates()``. A
    first start serves on such a model while its own plans are timed, and the timed model
    borrows the layouts the two share (``QuantLinear.borrow``): alike plans, one copy of the
    weights at the swap, not two."""
    if hints is None or selector.mode() != "auto":
        return Plan.always(methods[0])
    cached = hints.plans.get(name)
    if cached is not None and cached.covers(buckets) and cached.used() <= set(methods):
        return cached
    kind = name.split(" ", 2)[2]  # format|dtype|candidates
    votes = Counter(plan.single() for key, plan in hints.plans.items()
                    if key.startswith("qlinear ") and key.split(" ", 2)[2] == kind)
    usual = [choice for choice, _ in votes.most_common() if choice in methods]
    if usual or candidates is None or len(methods) < 2:
        return Plan.always(usual[0] if usual else methods[0])
    return probe(buckets, candidates(), hints.timer)


def probe(buckets: list[int], candidates: Candidates, timer: Timer = host_timer) -> Plan:
    """A first guess where there is no time to ``selector.choose``: one candidate for every
    row count, the one that loses least (``Plan.single``) over the best of ``PROBE_CALLS``
    calls each at the first, middle and last bucket up to ``PROBE_MAX_ROWS``; those
    ``selector.HOPELESS`` times behind at the first are not called at the others."""
    usable = [rows for rows in buckets if rows <= PROBE_MAX_ROWS] or buckets[:1]
    bounds = sorted({usable[0], usable[len(usable) // 2], usable[-1]})
    timings: list[dict[str, float]] = []
    for rows in bounds:
        fns = candidates(rows)
        if timings:
            fns = {name: fn for name, fn in fns.items() if name in timings[-1]}
        times = {name: timer(name, fn, PROBE_CALLS) for name, fn in fns.items()}
        best = min(times.values())
        keep = selector.HOPELESS * best
        timings.append({name: ms for name, ms in times.items() if ms <= keep})
    return Plan.always(Plan(tuple(bounds), tuple(min(t, key=t.__getitem__) for t in timings),
                            tuple(timings)).single())


class QuantPlanner:
    """Plans ``QuantLinear`` layers one at a time, each (shape, format, dtype) timed once
    (``auto`` with a ``cache``; else ``untimed_plan`` from ``hints``), and packs each for its
    plan at once: the loader plans a MoE layer's experts as soon as they are read, so their
    unpacked values never pile up (``gpu/model_loader.py``). ``one_layout``: keep one layout
    per weight (the model's quantized weights pass ``TWO_LAYOUTS_MAX_BYTES``)."""

    def __init__(self, max_rows: int, cache: PlanCache | None, one_layout: bool,
                 hints: PlanCache | None = None) -> None:
        self.cache = cache if selector.mode() == "auto" else None
        self.hints = hints
        self.buckets = selector.row_buckets(max_rows)
        self.one_layout = one_layout
        self.plans: dict[str, Plan] = {}

    def plan(self, layer: QuantLinear) -> None:
        """Set ``layer``'s plan and pack it for that plan (a planned layer keeps its own)."""
        w = layer.weight_format
        if w is None or layer.plan_name is not None:  # planned already (as it was read)
            if layer.plan_name is not None:
                self.plans.setdefault(layer.plan_name, layer.plan)
            return
        methods = candidate_methods(w, w.q.device, layer.dtype)
        name = "qlinear {}x{} {}|{}|{}".format(
            layer.out_features, layer.in_features, layer.format_name,
            str(layer.dtype).removeprefix("torch."), ",".join(methods))
        if name not in self.plans:
            timed = self.cache is not None and len(methods) > 1
            plan = (self.cache.get_or_choose(name, self.buckets,
                                             quant_candidates(w, layer.dtype, methods))
                    if timed else untimed_plan(
                        name, methods, self.buckets, self.hints,
                        lambda: quant_candidates(w, layer.dtype, methods)))
            self.plans[name] = Plan.always(plan.single()) if self.one_layout else plan
        layer.plan_name = name
        layer.replan(self.plans[name])


def plan_quant_linears(model: nn.Module, max_rows: int, cache: PlanCache | None,
                       two_layouts_max_bytes: int = TWO_LAYOUTS_MAX_BYTES,
                       hints: PlanCache | None = None) -> dict[str, Plan]:
    """Time each distinct quantized (shape, format, dtype) once (``auto`` with a ``cache``) and
    give every ``QuantLinear`` of ``model`` its plan; untimed, ``untimed_plan`` from ``hints``;
    ``force`` and ``off`` keep the first candidate. Quantized weights of more than
    ``two_layouts_max_bytes`` in all keep one layout each (a plan over two keeps two copies).
    Returns the plans by name, for the table (those of layers planned as they were read too)."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    one_layout = sum(m.format_nbytes for m in layers) > two_layouts_max_bytes
    planner = QuantPlanner(max_rows, cache, one_layout, hints)
    for layer in layers:
        planner.plan(layer)
    return planner.plans
