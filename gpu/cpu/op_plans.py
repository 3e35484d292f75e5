"""Plans for a model's CPU ops: which of tidal's kernels and torch's own paths runs each op at
each row count, timed on this host with random inputs of the model's shapes (``selector.py``),
set on the modules that run them, and logged as a table at start.

Ops and their row counts: the linears (``packed_linear.py``) and the norms, activation,
rotary embeddings and a MoE model's expert paths (``gpu/moe.py``) by the step's tokens;
decode attention by its decode rows (at a context of ``DECODE_CONTEXT`` positions); prefill
attention by a chunk's tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from tidal.gpu.attention.cpu_backend import CpuAttentionBackend
from tidal.gpu.attention.paged_layout import paged_layout, random_caches
from tidal.gpu.attention.torch_ref import TorchAttentionBackend
from tidal.gpu.cpu import selector
from tidal.gpu.cpu.kernels import denormals_flushed, load_cpu_kernels
from tidal.gpu.cpu.packed_linear import pack_linear_layers
from tidal.gpu.cpu.selector import KERNELS, TORCH, Plan, PlanCache
from tidal.gpu.layers import RMSNorm, RotaryEmbedding, SiluAndMul, silu_and_mul
from tidal.gpu.moe import MoE
from tidal.gpu.quantization.head import plan_head
from tidal.gpu.quantization.planner import plan_quant_linears

if TYPE_CHECKING:
    from tidal.gpu.cpu.backend import CpuBackend

logger = logging.getLogger(__name__)

DECODE_CONTEXT = 256  # positions each decode row attends over while timed
STACK, LAYERS = "one-call step", "layers"  # how a decode step may run (plan_decode_stack)
BLOCK_SIZE = 16

Candidates = Callable[[int], dict[str, Callable[[], object]]]


@dataclass
class ModelPlans:
    """A model's plans by name (``linear|NxK|...``, ``rms_norm``, ...), and where they came from."""

    plans: dict[str, Plan]
    measured: int  # how many were timed now rather than read from the cache
    seconds: float
    timed: bool = True  # False: defaults, with no timing (not ``auto``, or a stopgap model)

    def table(self) -> str:
        width = max(len(name) for name in self.plans)
        return "\n".join(f"  {name:{width}s}  {plan.describe()}"
                         for name, plan in sorted(self.plans.items()))

    def summary(self) -> str:
        """One line: the candidates each kind of op uses at some row count (every linear shape
        together), e.g. ``linear: mkl, panels; rms_norm: tidal; decode_attention: tidal``."""
        used: dict[str, set[str]] = {}
        for name, plan in self.plans.items():
            used.setdefault(name.split(" ")[0], set()).update(plan.used())
        return "; ".join(f"{op}: {', '.join(sorted(names))}" for op, names in sorted(used.items()))


def plan_model(model: nn.Module, max_rows: int, max_seqs: int,
               cache: PlanCache | None = None, timed: bool = True) -> ModelPlans:
    """Pack the model's linears and set every op's plan on its modules (``auto``: timed, or
    read from this host's cache; ``force``/``off``, or not ``timed``: the kernels where built,
    else oneDNN, else torch)."""
    start = time.perf_counter()
    auto = selector.mode() == "auto" and timed
    cache = cache if cache is not None else (PlanCache() if auto else None)
    hints = cache if not auto else None  # untimed: quantized linears as this host measured
    linears = pack_linear_layers(model, max_rows, cache if auto else None)
    plans: dict[str, Plan] = {f"linear {m.out_features}x{m.in_features}": m.plan
                              for m in linears}
    plans.update(plan_head(model, max_rows, cache if auto else None, hints=hints))
    plans.update(plan_quant_linears(model, max_rows, cache if auto else None, hints=hints))
    kernels = load_cpu_kernels()
    dtype = model.layers[0].input_layernorm.weight.dtype  # a pipeline stage may have no norm
    if auto and kernels is not None and cache is not None:
        with denormals_flushed():
            plans.update(_plan_ops(model, dtype, max_rows, max_seqs, cache))
        cache.save()
    measured = len(cache.measured) if cache is not None else 0
    return ModelPlans(plans, measured, time.perf_counter() - start, auto)


def _plan_ops(model: nn.Module, dtype: torch.dtype, max_rows: int, max_seqs: int,
              cache: PlanCache) -> dict[str, Plan]:
    cfg = model.local_config  # this rank's shapes under tensor parallelism
    rows, seqs = selector.row_buckets(max_rows), selector.row_buckets(max_seqs)
    tag = str(dtype).removeprefix("torch.")
    heads = f"{cfg.num_heads}/{cfg.num_kv_heads}x{cfg.head_dim}"
    attn = model.layers[0].self_attn
    plans = {
        "rms_norm": cache.get_or_choose(f"rms_norm|{cfg.hidden_size}|{tag}", rows,
                                        _norm_candidates(cfg.hidden_size, dtype)),
        "silu_and_mul": cache.get_or_choose(f"silu_and_mul|{cfg.intermediate_size}|{tag}",
                                            rows, _act_candidates(cfg.intermediate_size, dtype)),
        "rotary": cache.get_or_choose(f"rotary|{heads}|{tag}", rows,
                                      _rotary_candidates(attn.rotary, cfg, dtype)),
    }
    if isinstance(attn.backend, CpuAttentionBackend):
        plans["decode_attention"] = cache.get_or_choose(
            f"decode_attention|{heads}|{tag}|ctx{DECODE_CONTEXT}", seqs,
            _attention_candidates(attn.backend, cfg, dtype, decode=True))
        plans["prefill_attention"] = cache.get_or_choose(
            f"prefill_attention|{heads}|{tag}", rows,
            _attention_candidates(attn.backend, cfg, dtype, decode=False))
        attn.backend.decode_plan = plans["decode_attention"]
        attn.backend.prefill_plan = plans["prefill_attention"]
    # every MoE layer of a model has the same shapes; quantized experts take the grouped path
    moe = [m for m in model.modules() if isinstance(m, MoE) and not m.quantized]
    if moe:
        plans["moe"] = cache.get_or_choose(moe[0].plan_key(), rows, moe[0].candidates)
    for module in model.modules():
        if isinstance(module, MoE):
            module.plan = plans.get("moe")
        elif isinstance(module, RMSNorm):
            module.plan = plans["rms_norm"]
        elif isinstance(module, SiluAndMul):
            module.plan = plans["silu_and_mul"]
        elif isinstance(module, RotaryEmbedding):
            module.plan = plans["rotary"]
    return plans


def stack_rows(model: nn.Module, max_seqs: int) -> list[bool]:
    """For 0, 1, ... ``max_seqs`` rows: whether every op of a decode step gives them to the
    kernels, as the one-call decode step runs nothing else (its linears follow their plans).
    The rule where the step is not timed as a whole (``plan_decode_stack``)."""
    attn = model.layers[0].self_attn
    acts = [layer.mlp.act_fn for layer in model.layers if hasattr(layer.mlp, "act_fn")]
    act = acts[0] if acts else None  # experts' silu_and_mul has no plan: the kernel's always
    norm = model.norm if model.norm is not None else model.layers[0].input_layernorm  # a stage's
    plans = [norm.plan, act and act.plan, attn.rotary.plan,
             getattr(attn.backend, "decode_plan", None)]
    return [all(p is None or p.pick(r) == KERNELS for p in plans) for r in range(max_seqs + 1)]


def plan_decode_stack(model: nn.Module, cpu: CpuBackend, max_seqs: int,
                      cache: PlanCache) -> Plan:
    """Whether ``cpu``'s one-call decode step (``STACK``) beats the step through the model's
    layers (``LAYERS``, each op on its own plan) at each row count up to ``max_seqs``, timed
    as a whole: timing the ops one by one misses what the one call saves between them, so an
    op whose torch form wins alone could keep the faster step off."""
    linears = ",".join(sorted({type(m).__name__ for m in model.layers[0].modules()
                               if hasattr(m, "kernel")}))
    cfg, dtype = model.local_config, model.norm.weight.dtype
    experts = (f"|{cfg.num_experts}e top{cfg.num_experts_per_tok} x{cfg.moe_intermediate_size}"
               if cfg.num_experts else "")
    key = (f"decode_stack|{cfg.hidden_size}x{cfg.intermediate_size}x{cfg.num_layers}{experts}|"
           f"{cfg.num_heads}/{cfg.num_kv_heads}x{cfg.head_dim}|{linears}|"
           f"{str(dtype).removeprefix('torch.')}|ctx{min(DECODE_CONTEXT, model.max_positions)}")
    with denormals_flushed():
        plan = cache.get_or_choose(key, selector.row_buckets(max_seqs),
                                   _stack_candidates(model, cpu))
    return plan


def _stack_candidates(model: nn.Module, cpu: CpuBackend) -> Candidates:
    cfg, dtype = model.local_config, model.norm.weight.dtype

    context = min(DECODE_CONTEXT, model.max_positions)  # the rotary table's length

    def candidates(rows: int) -> dict[str, Callable[[], object]]:
        meta = paged_layout([context - 1] * rows, [1] * rows, BLOCK_SIZE, seed=rows)
        caches = [random_caches(meta, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, dtype)]
        caches = caches * cfg.num_layers  # one layer's, read by every layer
        ids = torch.randint(0, model.embed_tokens.num_embeddings, (rows,))
        positions = torch.full((rows,), context - 1, dtype=torch.long)
        stack = replace(cpu, stack_rows=[True] * (rows + 1))  # takes every decode step

        def step(on_stack: bool) -> torch.Tensor:
            with torch.inference_mode():
                hidden = stack.forward(ids, positions, caches, meta) if on_stack else None
                return hidden if hidden is not None else model(ids, positions, caches, meta)

        return {STACK: lambda: step(True), LAYERS: lambda: step(False)}

    return candidates


def _forced(choice: str) -> Plan:
    return Plan.always(choice)


def _norm_candidates(hidden: int, dtype: torch.dtype) -> Candidates:
    norms = {name: RMSNorm(hidden, 1e-6).to(dtype) for name in (KERNELS, TORCH)}
    for name, norm in norms.items():
        norm.plan = _forced(name)

    def candidates(rows: int) -> dict[str, Callable[[], object]]:
        x, delta = torch.randn(rows, hidden).to(dtype), torch.randn(rows, hidden).to(dtype)
        return {name: (lambda n=norm: n.add_and_norm(x, delta)) for name, norm in norms.items()}

    return candidates


def _act_candidates(intermediate: int, dtype: torch.dtype) -> Candidates:
    def candidates(rows: int) -> dict[str, Callable[[], object]]:
        gate_up = torch.randn(rows, 2 * intermediate).to(dtype)
        return {name: (lambda n=name: silu_and_mul(gate_up, _forced(n)))
                for name in (KERNELS, TORCH)}

    return candidates


def _rotary_candidates(rotary: nn.Module, cfg, dtype: torch.dtype) -> Candidates:
    saved = rotary.plan

    def run(name: str, positions, q, k) -> tuple[torch.Tensor, torch.Tensor]:
        rotary.plan = _forced(name)
        try:
            return rotary(positions, q.clone(), k.clone())
        finally:
            rotary.plan = saved

    def candidates(rows: int) -> dict[str, Callable[[], object]]:
        positions = torch.arange(rows) % rotary.cos.shape[0]
        q = torch.randn(rows, cfg.num_heads, cfg.head_dim).to(dtype)
        k = torch.randn(rows, cfg.num_kv_heads, cfg.head_dim).to(dtype)
        return {name: (lambda n=name: run(n, positions, q, k)) for name in (KERNELS, TORCH)}

    return candidates


def _attention_candidates(backend: CpuAttentionBackend, cfg, dtype: torch.dtype,
                          decode: bool) -> Candidates:
    ours = CpuAttentionBackend(backend.kernels)
    ours.decode_plan = ours.prefill_plan = _forced(KERNELS)
    backends = {KERNELS: ours, TORCH: TorchAttentionBackend()}

    def candidates(rows: int) -> dict[str, Callable[[], object]]:
        if decode:
            meta = paged_layout([DECODE_CONTEXT - 1] * rows, [1] * rows, BLOCK_SIZE, seed=rows)
        else:
            meta = paged_layout([0], [rows], BLOCK_SIZE, seed=rows)
        keys, values = random_caches(meta, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, dtype)
        query = torch.randn(meta.num_actual_tokens, cfg.num_heads, cfg.head_dim).to(dtype)
        scale = cfg.head_dim ** -0.5
        return {name: (lambda b=b: b.forward(query, keys, values, meta, scale))
                for name, b in backends.items()}

    return candidates


def log_plans(result: ModelPlans) -> None:
    how = (f"timed {result.measured} in {result.seconds:.1f} s" if result.measured
           else "from this host's cache" if result.timed else "defaults, untimed")
    logger.info("CPU ops (%s mode, %s):\n%s", selector.mode(), how, result.table())


