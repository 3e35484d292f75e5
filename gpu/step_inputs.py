"""A step's model inputs, and where its tokens sit in the flattened batch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tidal.core.scheduler_output import SchedulerOutput
from tidal.gpu.attention import AttentionMetadata
from tidal.gpu.input_batch import CachedRequestState
from tidal.gpu.spec_step import SpecRows


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor | None  # the rows to sample from; None: every row, in order
    sampling_states: list[CachedRequestState]
    spec: SpecRows | None = None  # a step with proposals to verify: the rows of each request


@dataclass
class TokenLayout:
    """Where a step's tokens sit: request ``i`` owns tokens ``cu[i]:cu[i + 1]`` of the
    flattened batch, at sequence positions ``positions``."""

    cu: np.ndarray  # [R + 1]
    positions: np.ndarray  # [T]
    seq_lens: np.ndarray  # [R]: each request's length once this step has run
    max_query_len: int
    req_of_token: np.ndarray | None  # [T]: each token's request; None: token i is request i's

    @classmethod
    def of(cls, sched: SchedulerOutput, computed: np.ndarray) -> TokenLayout:
        """The layout of ``sched``'s tokens after each request's ``computed`` ones."""
        n = len(computed)
        if sched.total_num_scheduled_tokens == n:  # decodes only: one token each, in order
            return cls(np.arange(n + 1), computed, computed + 1, 1, None)
        num_new = np.fromiter(sched.num_scheduled_tokens.values(), dtype=np.int64, count=n)
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(num_new, out=cu[1:])
        req_of_token = np.repeat(np.arange(n), num_new)
        positions = computed[req_of_token] + np.arange(cu[-1]) - cu[req_of_token]
        return cls(cu, positions, computed + num_new, int(num_new.max()), req_of_token)

    def per_token(self, per_request: np.ndarray) -> np.ndarray:
        """A per-request array spread over the tokens."""
        return per_request if self.req_of_token is None else per_request[self.req_of_token]

    def request_of(self, tokens: np.ndarray) -> np.ndarray:
        """The requests of the tokens at these indices."""
        return tokens if self.req_of_token is None else self.req_of_token[tokens]


def advance(states: list[CachedRequestState], seq_lens: list[int],
            spec: dict[str, list[int]] | None = None) -> tuple[list[int], bool]:
    """Count each request's scheduled tokens as computed (``seq_lens``: its length once the
    step has run). Returns the indices of those that sample, their known tokens all computed
    (any tokens in flight and proposals in ``spec`` included), and whether any input token is
    still in flight."""
    sampling = []
    in_flight = False
    for i, (state, seq_len) in enumerate(zip(states, seq_lens)):
        state.num_computed_tokens = seq_len
        known = state.num_tokens + len(spec.get(state.req_id, ())) if spec else state.num_tokens
        if seq_len > known:
            in_flight = True
        if seq_len >= known + state.num_pending:
            sampling.append(i)
    return sampling, in_flight


def fill_in_flight(input_ids: torch.Tensor, layout: TokenLayout,
                   states: list[CachedRequestState], last_sampled: torch.Tensor,
                   last_index: dict[str, int],
                   to_dev: Callable[[np.ndarray], torch.Tensor]) -> None:
    """The input ids past the known tokens: sampled by the step in flight (``last_sampled``,
    a request's row in ``last_index``), they are still on the device."""
    known = np.array([s.num_tokens for s in states], dtype=np.int64)
    unknown = np.nonzero(layout.positions >= layout.per_token(known))[0]
    src = [last_index[states[r].req_id] for r in layout.request_of(unknown)]
    input_ids[to_dev(unknown)] = last_sampled[to_dev(np.asarray(src, dtype=np.int64))]
