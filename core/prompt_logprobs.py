"""Prompt logprobs (``SamplingParams.prompt_logprobs``, vLLM's field): the logprob of each
prompt token given the tokens before it, with its rank and the prompt position's top-k.

The runner scores the prefill positions of a request that asks, chunk by chunk
(``PromptLogprobsChunk``); the scheduler gathers the chunks into the request's
``PromptScores``; the output processor hands them out once, in vLLM's shape: a list with
``None`` for the first token (nothing precedes it), then per token a dict token id ->
``Logprob`` holding the actual prompt token and the top-k.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tidal.core.outputs import Logprob, PromptLogprobs

if TYPE_CHECKING:
    from tidal.core.request import Request


@dataclass
class PromptLogprobsChunk:
    """One step's scores of one request's prompt: row ``j`` scores prompt token
    ``start + j + 1`` (from the logits at position ``start + j``)."""

    start: int
    token_ids: list[list[int]]  # per row: the actual next prompt token, then the top-k
    logprobs: list[list[float]]  # their logprobs, in the same order
    ranks: list[int]  # per row: the actual token's rank in the vocabulary (1 = the likeliest)


@dataclass
class PromptScores:
    """A request's prompt logprobs as its prefill chunks come in."""

    num_prompt_tokens: int
    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    sent: bool = False  # handed out already (a preempted request recomputes its prompt)

    @property
    def complete(self) -> bool:
        return len(self.ranks) >= self.num_prompt_tokens - 1

    def add(self, chunk: PromptLogprobsChunk) -> None:
        """Take a chunk's rows past those already held: after a preemption the prompt's
        positions are computed again, and their scores are the same."""
        skip = len(self.ranks) - chunk.start
        if skip < 0:  # a gap cannot happen: chunks come in position order
            raise ValueError(f"prompt logprobs from position {chunk.start}, expected "
                             f"{len(self.ranks)}")
        self.token_ids += chunk.token_ids[skip:]
        self.logprobs += chunk.logprobs[skip:]
        self.ranks += chunk.ranks[skip:]

    def as_vllm(self, decode: Callable[[int], str] | None) -> PromptLogprobs:
        """vLLM's shape; ``decode`` gives each token's ``decoded_token`` (None: left out).
        Each top-k entry's rank is its place among them; the actual token's is its own."""
        out: PromptLogprobs = [None]
        for ids, values, rank in zip(self.token_ids, self.logprobs, self.ranks):
            entry: dict[int, Logprob] = {}
            for place, (token_id, value) in enumerate(zip(ids[1:], values[1:]), start=1):
                entry[token_id] = Logprob(value, place, decode(token_id) if decode else None)
            entry[ids[0]] = Logprob(values[0], rank, decode(ids[0]) if decode else None)
            out.append(entry)
        return out


def add_prompt_chunks(requests: Mapping[str, Request],
                      chunks: Mapping[str, PromptLogprobsChunk]) -> None:
    """A step's chunks into their requests' scores (a request finished meanwhile is gone)."""
    for req_id, chunk in chunks.items():
        request = requests.get(req_id)
        if request is not None and request.prompt_scores is not None:
            request.prompt_scores.add(chunk)
