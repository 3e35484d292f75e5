"""Pooling on the device (``--runner pooling``, core/pooling.py): each step's final hidden
states (the final norm's output) pooled per request into its embedding.

A prompt may run in several chunks (chunked prefill), so what a request pools is gathered
across steps: the sum of its rows for mean pooling, its first row for CLS, its last prompt
row for last-token pooling. A request's embedding is handed out by the step that computes
the last of its prompt; the scheduler then finishes it. A sequence classifier's last-token
pool goes on through its ``score`` head into its labels' probabilities.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tidal.core.pooling import PoolingConfig
from tidal.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from tidal.gpu.input_batch import InputBatch


@dataclass
class PoolPlan:
    """Which of a step's hidden rows each of its requests pools: row ``rows[j]`` goes to
    request ``req_ids[segments[j]]``."""

    req_ids: list[str]  # the requests that pool rows this step or finish their prompt in it
    rows: np.ndarray  # [N]: rows of the step's hidden states
    segments: np.ndarray  # [N]: each row's index into req_ids
    restarts: list[bool]  # per request: this step holds its prompt's first position
    done: list[bool]  # per request: this step computes the last of its prompt
    num_prompt_tokens: list[int]


class PooledHandle:
    """A pooling step's embeddings, brought to the host by ``result()``."""

    def __init__(self, req_ids: list[str], embeddings: torch.Tensor | None) -> None:
        self.req_ids, self.embeddings = req_ids, embeddings

    def result(self) -> ModelRunnerOutput:
        if self.embeddings is None:
            return ModelRunnerOutput.empty()
        rows = self.embeddings.cpu().tolist()
        return ModelRunnerOutput([], [], pooled=dict(zip(self.req_ids, rows)))


class Pooler:
    """Pools the runner's steps as ``config`` says, holding the partial pools of the prompts
    still running (on the device, in float32)."""

    def __init__(self, config: PoolingConfig) -> None:
        self.config = config
        self._partial: dict[str, torch.Tensor] = {}

    def plan(self, batch: InputBatch, sched: SchedulerOutput) -> PoolPlan:
        """The step's rows to pool, read before the step advances the batch's computed
        counts."""
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            self._partial.pop(req_id, None)  # a preempted request computes its prompt again
        method = self.config.method
        plan = PoolPlan([], np.empty(0, np.int64), np.empty(0, np.int64), [], [], [])
        rows: list[np.ndarray] = []
        segments: list[np.ndarray] = []
        offset = 0
        for req_id, n in sched.num_scheduled_tokens.items():
            state = batch.states[req_id]
            start, prompt_len = state.num_computed_tokens, state.num_prompt_tokens
            end = min(start + n, prompt_len)
            done = end >= prompt_len
            picked = offset + _pooled_positions(method, start, end, done) - start
            offset += n
            if not len(picked) and not done:
                continue
            rows.append(picked)
            segments.append(np.full(len(picked), len(plan.req_ids)))
            plan.req_ids.append(req_id)
            plan.restarts.append(start == 0)
            plan.done.append(done)
            plan.num_prompt_tokens.append(prompt_len)
        if rows:
            plan.rows, plan.segments = np.concatenate(rows), np.concatenate(segments)
        return plan

    def pool(self, plan: PoolPlan, hidden: torch.Tensor,
             to_device: Callable[[np.ndarray], torch.Tensor],
             model: nn.Module | None = None) -> PooledHandle:
        """Add the step's ``hidden`` rows to the partial pools; the finished prompts'
        embeddings, normalised if the config says so, in the returned handle (a classifier's:
        its labels' probabilities, from ``model``'s ``score`` head)."""
        if not plan.req_ids:
            return PooledHandle([], None)
        sums = torch.zeros(len(plan.req_ids), hidden.shape[-1], dtype=torch.float32,
                           device=hidden.device)
        if len(plan.rows):
            picked = hidden.index_select(0, to_device(plan.rows)).float()
            if self.config.method == "mean":
                sums.index_add_(0, to_device(plan.segments), picked)
            else:  # a row a request at most: placed, not summed (a CPU index_add_ is slow)
                sums.index_copy_(0, to_device(plan.segments), picked)
        finished_ids, finished = [], []
        for i, req_id in enumerate(plan.req_ids):
            earlier = None if plan.restarts[i] else self._partial.pop(req_id, None)
            total = sums[i] if earlier is None else earlier + sums[i]
            if not plan.done[i]:
                self._partial[req_id] = total
                continue
            if self.config.method == "mean":
                total = total / plan.num_prompt_tokens[i]
            finished_ids.append(req_id)
            finished.append(total)
        if not finished:
            return PooledHandle([], None)
        embeddings = torch.stack(finished)
        if self.config.is_classifier:
            head = getattr(model, "score", None)
            if head is None:
                raise ValueError("a sequence classifier's model has no score head")
            return PooledHandle(finished_ids, label_probs(head(embeddings.to(hidden.dtype))))
        if self.config.normalize:
            embeddings = torch.nn.functional.normalize(embeddings, p=2.0, dim=-1)
        return PooledHandle(finished_ids, embeddings)


def label_probs(logits: torch.Tensor) -> torch.Tensor:
    """``[n, num_labels]`` logits as probabilities, in float32: the sigmoid of a single
    label's, else the softmax (vLLM's classify and sentence-transformers' defaults)."""
    logits = logits.float()
    return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)


def _pooled_positions(method: str, start: int, end: int, done: bool) -> np.ndarray:
    """The prompt positions in ``start:end`` (one step's chunk) that ``method`` pools."""
    if method == "mean":
        return np.arange(start, max(start, end))
    if method == "cls":
        return np.arange(start, 1)  # position 0, in the chunk that holds it
    return np.arange(end - 1, end) if done else np.arange(0)  # the last prompt position
