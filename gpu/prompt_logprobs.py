"""Prompt logprobs on the device: the scores of the prefill positions of the requests in a
step that ask for them (``SamplingParams.prompt_logprobs``), from the step's hidden states.

Only those positions go through the output head, a slice of rows at a time, so a step in
which no request asks costs nothing and a long chunk's full-vocabulary logits never sit in
memory at once. Logprobs are ``log_softmax`` of the raw float32 logits, as for sampled tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tidal.core.prompt_logprobs import PromptLogprobsChunk
from tidal.core.scheduler_output import SchedulerOutput
from tidal.gpu.input_batch import InputBatch

ROWS_PER_SLICE = 256  # prompt positions sent through the output head at once


@dataclass
class PromptRows:
    """Which of a step's tokens are scored: request ``req_ids[i]``'s ``counts[i]`` rows score
    its prompt tokens from ``starts[i] + 1`` on, with its top ``ks[i]``."""

    req_ids: list[str]
    starts: list[int]
    counts: list[int]
    ks: list[int]
    hidden_rows: np.ndarray  # [N]: the rows of the step's hidden states
    targets: np.ndarray  # [N]: the prompt token each row scores


@dataclass
class PromptScoresOut:
    """The scores of a step's ``PromptRows``, on the device until ``chunks`` reads them."""

    rows: PromptRows
    token_ids: torch.Tensor  # [N, 1 + K]: the target token, then the top-K (K: the most asked)
    logprobs: torch.Tensor  # [N, 1 + K]
    ranks: torch.Tensor  # [N]

    def chunks(self) -> dict[str, PromptLogprobsChunk]:
        """Per request, its rows cut to its own top-k (host lists; reads the tensors)."""
        ids, values, ranks = self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        out, at = {}, 0
        rows = self.rows
        for req_id, start, count, k in zip(rows.req_ids, rows.starts, rows.counts, rows.ks):
            end = at + count
            out[req_id] = PromptLogprobsChunk(
                start, [r[: k + 1] for r in ids[at:end]], [r[: k + 1] for r in values[at:end]],
                ranks[at:end])
            at = end
        return out


def plan_prompt_rows(batch: InputBatch, sched: SchedulerOutput) -> PromptRows | None:
    """The step's prompt positions to score, read before the step advances the batch's
    computed counts; None when no request in the batch asks (checked by a counter)."""
    if not batch.num_prompt_logprobs:
        return None
    req_ids, starts, counts, ks = [], [], [], []
    hidden_rows, targets = [], []
    offset = 0
    for req_id, n in sched.num_scheduled_tokens.items():
        state = batch.states[req_id]
        k = state.params.prompt_logprobs
        start = state.num_computed_tokens
        end = min(start + n, state.num_prompt_tokens - 1)  # the last one's logits sample
        if k is not None and end > start:
            req_ids.append(req_id)
            starts.append(start)
            counts.append(end - start)
            ks.append(k)
            hidden_rows.append(np.arange(offset, offset + end - start))
            targets.append(batch.token_ids[state.row, start + 1:end + 1])
        offset += n
    if not req_ids:
        return None
    return PromptRows(req_ids, starts, counts, ks, np.concatenate(hidden_rows),
                      np.concatenate(targets))


def score_prompt_rows(rows: PromptRows, hidden: torch.Tensor,
                      compute_logits: Callable[[torch.Tensor], torch.Tensor],
                      to_device: Callable[[np.ndarray], torch.Tensor]) -> PromptScoresOut:
    """Score ``rows`` from the step's ``hidden`` states through ``compute_logits``
    (``to_device``: the runner's copy of host arrays, which does not sync)."""
    index = to_device(rows.hidden_rows)
    targets = to_device(rows.targets)
    k = max(rows.ks)
    parts = []
    for a in range(0, len(index), ROWS_PER_SLICE):
        logprobs = torch.log_softmax(
            compute_logits(hidden.index_select(0, index[a:a + ROWS_PER_SLICE])).float(), dim=-1)
        target = targets[a:a + ROWS_PER_SLICE, None]
        own = logprobs.gather(1, target)
        rank = (logprobs > own).sum(dim=-1) + 1
        top = logprobs.topk(k, dim=-1)
        parts.append((torch.cat([target, top.indices], dim=1),
                      torch.cat([own, top.values], dim=1), rank))
    ids, values, ranks = (torch.cat(p) for p in zip(*parts))
    return PromptScoresOut(rows, ids, values, ranks)
