"""The runner's side of speculative decoding: a request's proposed tokens run after its last
known token in the same forward (several query rows of one request, attending causally over
its cache like a prefill chunk), logits at each of its ``k + 1`` positions, and the verified
tokens grouped back by request (docs/speculative-decoding.md)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from tidal.core.outputs import TokenLogprobs
from tidal.gpu.cuda_graphs import CudaGraphRunner
from tidal.gpu.input_batch import CachedRequestState, InputBatch


@dataclass
class SpecRows:
    """A speculative step's logits rows: each sampling request's proposals and one more,
    in request order."""

    num_rows: list[int]  # per sampling request: its proposals + 1
    drafts: torch.Tensor  # [N] long: the token proposed at each row, -1 at a request's last
    # per row: the request as of that row, its proposals before the row counted as known
    # tokens (so penalties and min_tokens see them); a view for the sampling metadata, or
    # the request's own state where no row needs metadata (``spec_rows``' ``views``)
    row_states: list[CachedRequestState]


@dataclass
class AttentionRows:
    """Who a step's attention sees as its requests: the rows of the block table their blocks
    are read from, their query start offsets and their lengths after the step."""

    rows: np.ndarray
    cu: np.ndarray
    seq_lens: np.ndarray
    max_query_len: int

    @classmethod
    def one_per_token(cls, token_rows: np.ndarray, positions: np.ndarray) -> AttentionRows:
        """Each query row a request of its own over its request's blocks, as long as its
        position + 1: it attends causally over the cache as its chunk's row would, and the
        step is a decode step (k + 1 rows a request) that the CPU's one-call decode step and
        decode attention take, not the layered forward with prefill attention."""
        n = len(positions)
        return cls(token_rows, np.arange(n + 1, dtype=np.int64), positions + 1, 1)

    @classmethod
    def of_step(cls, rows: np.ndarray, cu: np.ndarray, seq_lens: np.ndarray,
                token_rows: np.ndarray, positions: np.ndarray, max_query_len: int,
                turn_up_to: int) -> AttentionRows:
        """A step's requests as they are, or one per token (``one_per_token``) where its
        longest query is at most ``turn_up_to`` (a verification's proposals + 1; 0: never):
        prefill chunks attend as chunks."""
        if max_query_len <= turn_up_to:
            return cls.one_per_token(token_rows, positions)
        return cls(rows, cu, seq_lens, max_query_len)


def rows_as_decode(device: str, graphs: CudaGraphRunner | None, num_rows: int) -> bool:
    """Whether a step's ``num_rows`` query rows can run as one-token rows: on the CPU (its
    one-call decode step takes them), or where a captured CUDA graph holds them all."""
    return device == "cpu" or (graphs is not None and graphs.holds(num_rows))


def decode_turn(spec: dict[str, list[int]], as_decode: bool) -> int:
    """``AttentionRows.of_step``'s ``turn_up_to`` for a step verifying ``spec``: its longest
    proposals and one more where its rows run as one-token rows (``as_decode``: the CPU's
    one-call decode step takes them, or a captured CUDA graph holds them all), else 0."""
    return 1 + max(map(len, spec.values())) if spec and as_decode else 0


def write_drafts(batch: InputBatch, states: list[CachedRequestState],
                 spec: dict[str, list[int]]) -> None:
    """Put each request's proposals after its known tokens, where the forward reads its
    input ids (the verified tokens overwrite them once the step is done)."""
    for state in states:
        drafts = spec.get(state.req_id)
        if drafts:
            batch.token_ids[state.row, state.num_tokens:state.num_tokens + len(drafts)] = drafts


def spec_rows(states: list[CachedRequestState], last_token: np.ndarray,
              spec: dict[str, list[int]], device: torch.device | str, views: bool = True
              ) -> tuple[np.ndarray, SpecRows]:
    """The logits rows of the sampling ``states`` (``last_token``: the index of each one's
    last token in the flattened batch), and what verifying them needs. ``views``: each row
    a view of its request counting the proposals before it, which penalties, min_tokens and
    logprobs read; without (no row of the batch needs sampling metadata) a request's rows
    share its state, whose ``req_id`` alone is then read."""
    indices: list[np.ndarray] = []
    num_rows: list[int] = []
    drafts: list[int] = []
    row_states: list[CachedRequestState] = []
    for state, last in zip(states, last_token.tolist()):
        proposed = spec.get(state.req_id, [])
        k = len(proposed)
        indices.append(np.arange(last - k, last + 1, dtype=np.int64))
        num_rows.append(k + 1)
        drafts += proposed
        drafts.append(-1)
        row_states.append(state)
        row_states += ([dataclasses.replace(state, num_tokens=state.num_tokens + j)
                        for j in range(1, k + 1)] if views else [state] * k)
    ids = torch.from_numpy(np.asarray(drafts, dtype=np.int64))
    rows = SpecRows(num_rows, ids if str(device) == "cpu" else ids.to(device), row_states)
    return np.concatenate(indices), rows


def group_by_request(spec: SpecRows, token_ids: list[int], accepted: list[bool],
                     logprobs: list[TokenLogprobs] | None
                     ) -> tuple[list[list[int]], list[list[TokenLogprobs]] | None]:
    """Each request's tokens: its rows' up to and including the first whose proposal was not
    accepted (its last row has none), with their logprobs."""
    tokens: list[list[int]] = []
    grouped: list[list[TokenLogprobs]] | None = None if logprobs is None else []
    start = 0
    for n in spec.num_rows:
        end = start
        while end < start + n - 1 and accepted[end]:
            end += 1
        tokens.append(token_ids[start:end + 1])
        if grouped is not None and logprobs is not None:
            grouped.append(logprobs[start:end + 1])
        start += n
    return tokens, grouped
