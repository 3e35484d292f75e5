"""The CPU side of a model prepared to run on the CPU: its ops' plans and the one-call decode
step.

``prepare_for_cpu`` plans every op of the model, setting each plan on the layer that runs the op
and packing the linears as planned (``op_plans.py``), and builds the one-call decode step
(``decode_stack.py``) where it applies. The runner holds the ``CpuBackend`` it returns beside the
model and offers each step to it before the model's forward: a decode step of a row count that
the plans give to the one call runs there, every other step through the model's layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from tidal.gpu.attention import AttentionMetadata
from tidal.gpu.cpu import selector
from tidal.gpu.cpu.decode_stack import build_decode_stack, runs_on_stack, stack_takes
from tidal.gpu.cpu.op_plans import (
    STACK,
    ModelPlans,
    log_plans,
    plan_decode_stack,
    plan_model,
    stack_rows,
)
from tidal.gpu.cpu.selector import Plan, PlanCache
from tidal.gpu.quantization.experts import compile_blocks
from tidal.gpu.quantization.head import QuantEmbedding


@dataclass
class CpuBackend:
    """A model's CPU plans and its one-call decode step, where it has one."""

    plans: ModelPlans  # for the start-up banner (ModelRunner.kernel_summary)
    stack: Any | None = None  # decode_stack's DecodeStack; None where it does not apply
    stack_rows: list[bool] = field(default_factory=list)  # whether a step of so many rows takes it
    embedding: nn.Module | None = None  # the model's token embedding, which the stack looks up
    stack_plan: Plan | None = None  # the decode step timed whole, where it was (plan_decode_stack)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, ...]],
                meta: AttentionMetadata) -> torch.Tensor | None:
        """The step's final hidden states from the one-call decode step, or None where it does
        not take the step: then the model's forward runs it."""
        if self.stack is None or not runs_on_stack(input_ids, meta, self.stack_rows):
            return None
        ids = self._stack_ids(input_ids)
        if ids is None:
            return None
        requests, rows = meta.decode_rows_cpu
        caches = [cache for pair in kv_caches for cache in pair]
        return self.stack.forward(ids, positions, caches, meta.slot_mapping, meta.block_table,
                                  meta.seq_lens, requests, rows)

    def takes(self, rows: int) -> bool:
        """Whether the one-call decode step takes a step of ``rows`` one-token rows."""
        return self.stack is not None and stack_takes(rows, self.stack_rows)

    def propose(self, ids: np.ndarray, positions: np.ndarray,
                kv_caches: list[tuple[torch.Tensor, ...]], table: np.ndarray,
                row_requests: np.ndarray, guess_requests: np.ndarray, last_rows: np.ndarray,
                head: nn.Module, steps: int, block_size: int) -> np.ndarray | None:
        """A draft model's greedy guesses in one call (``DecodeStack.propose``: rows ``ids``
        at ``positions``, row i a one-token query of request ``row_requests[i]`` over its
        ``table`` row; then ``steps`` guesses each for ``guess_requests``, the first after
        their ``last_rows``), [guesses, steps]; None where the one-call step does not take
        it: no stack, an int8 embedding, a head without a C++ kernel, or row counts the
        plans give to the model's layers."""
        kernel = getattr(head, "kernel", None)
        if (kernel is None or isinstance(self.embedding, QuantEmbedding)
                or not self.takes(len(ids)) or not self.takes(len(guess_requests))):
            return None
        t = torch.from_numpy
        caches = [cache for pair in kv_caches for cache in pair]
        return self.stack.propose(t(ids), t(positions), caches, t(table), t(row_requests),
                                  t(guess_requests), t(last_rows), kernel, steps,
                                  block_size).numpy()

    def _stack_ids(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """The ids the one-call decode step looks up in its table: an int8 embedding's rows
        are dequantized into its staged table first (``None`` where they do not fit)."""
        if isinstance(self.embedding, QuantEmbedding):
            return self.embedding.stage(input_ids)
        return input_ids


def prepare_for_cpu(model: nn.Module, max_rows: int, max_seqs: int,
                    plan_cache: PlanCache | None = None, timed: bool = True) -> CpuBackend:
    """Plan every op, pack the linears as planned, give quantized experts their C++ blocks,
    and build the one-call decode step."""
    timed_here = timed and selector.mode() == "auto"
    cache = plan_cache if plan_cache is not None else (PlanCache() if timed_here else None)
    plans = plan_model(model, max_rows, max_seqs, cache, timed)
    log_plans(plans)
    compile_blocks(model)  # quantized experts' C++ blocks, which the decode step calls too
    cpu = CpuBackend(plans, build_decode_stack(model, max(max_rows, max_seqs)),
                     stack_rows(model, max_seqs), model.embed_tokens)
    if cpu.stack is not None and timed_here and cache is not None:
        cpu.stack_plan = plan_decode_stack(model, cpu, max_seqs, cache)
        cpu.stack_rows = [cpu.stack_plan.pick(r) == STACK for r in range(max_seqs + 1)]
        cache.save()
    return cpu
