"""A launched step's sampled tokens, brought to the host when the engine asks for them."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import TypeVar

import torch

from tidal.core.outputs import TokenLogprobs
from tidal.core.scheduler_output import ModelRunnerOutput
from tidal.gpu.input_batch import CachedRequestState, InputBatch
from tidal.gpu.prompt_logprobs import PromptScoresOut
from tidal.gpu.sampler import SamplerOutput
from tidal.gpu.spec_step import SpecRows, group_by_request


class StepHandle:
    """A launched step's sampled tokens (and prompt scores), copied to (pinned) host memory
    without blocking; ``result()`` waits on the copy's event, never on the whole device."""

    def __init__(self, batch: InputBatch, states: list[CachedRequestState], req_ids: list[str],
                 sampled: SamplerOutput | None,
                 prompt_scores: PromptScoresOut | None = None,
                 spec: SpecRows | None = None) -> None:
        self.batch, self.states, self.req_ids, self.sampled = batch, states, req_ids, sampled
        self.prompt_scores = prompt_scores
        self.spec = spec  # a speculative step's rows (gpu/spec_step.py)
        self._event = None
        on_gpu = False
        if sampled is not None and sampled.sampled_token_ids.is_cuda:
            self.sampled = sampled = _copy_to_pinned(sampled)  # every tensor: reading none syncs
            on_gpu = True
        if prompt_scores is not None and prompt_scores.ranks.is_cuda:
            self.prompt_scores = _copy_to_pinned(prompt_scores)
            on_gpu = True
        if on_gpu:
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> ModelRunnerOutput:
        if self.sampled is None and self.prompt_scores is None:
            return ModelRunnerOutput.empty()
        if self._event is not None:
            self._event.synchronize()
        prompt = None if self.prompt_scores is None else self.prompt_scores.chunks()
        if self.sampled is None:
            return ModelRunnerOutput([], [], prompt_logprobs=prompt)
        token_ids = self.sampled.sampled_token_ids.tolist()
        if self.spec is None:
            per_request = [[t] for t in token_ids]
            logprobs = _logprobs_dicts(self.states, self.sampled)
            grouped = None if logprobs is None else [[entry] for entry in logprobs]
        else:
            assert self.sampled.accepted is not None
            per_request, grouped = group_by_request(
                self.spec, token_ids, self.sampled.accepted.tolist(),
                _logprobs_dicts(self.spec.row_states, self.sampled))
        self.batch.append_tokens(self.states, per_request)
        if self.spec is not None:  # the rejected proposals' KV is to be written again
            for state, n, tokens in zip(self.states, self.spec.num_rows, per_request):
                state.num_computed_tokens -= n - len(tokens)
        return ModelRunnerOutput(self.req_ids, per_request, grouped, prompt_logprobs=prompt)


Copied = TypeVar("Copied", SamplerOutput, PromptScoresOut)


def _copy_to_pinned(sampled: Copied) -> Copied:
    """A dataclass's device tensors, copied to pinned host memory without blocking."""
    host = {}
    for f in fields(sampled):
        value = getattr(sampled, f.name)
        if isinstance(value, torch.Tensor):
            host[f.name] = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            host[f.name].copy_(value, non_blocking=True)
    return replace(sampled, **host)


def _logprobs_dicts(states: list[CachedRequestState],
                    sampled: SamplerOutput) -> list[TokenLogprobs] | None:
    if sampled.logprobs is None or sampled.logprob_token_ids is None:
        return None
    ids = sampled.logprob_token_ids.tolist()
    values = sampled.logprobs.tolist()
    out: list[TokenLogprobs] = []
    for state, row_ids, row_values in zip(states, ids, values):
        n = state.params.logprobs
        out.append({} if n is None else dict(zip(row_ids[: n + 1], row_values[: n + 1])))
    return out
