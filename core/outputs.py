"""What the engine hands back: per-request deltas and the collector that merges them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidal.core.lifecycle import RequestStats

# One entry per generated token: {token_id: logprob} holding the sampled token and the top-N.
TokenLogprobs = dict[int, float]


@dataclass(slots=True)
class Logprob:
    """A prompt token's logprob in vLLM's shape (``RequestOutput.prompt_logprobs``)."""

    logprob: float
    rank: int | None = None  # 1: the likeliest token at its position
    decoded_token: str | None = None


# ``None`` for the first prompt token, then per token {token_id: Logprob}: the actual token
# and the top-k (core/prompt_logprobs.py)
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence (one of ``n`` choices) of a request."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A request's state or, when streaming, the delta since the last output."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    # the lifecycle of each engine request (choice) that finished in this delta
    finished_stats: list[RequestStats] = field(default_factory=list)
    # with ``SamplingParams.prompt_logprobs``: in the first delta after the prompt is scored
    prompt_logprobs: PromptLogprobs | None = None
    # with ``SamplingParams.pooling``: the prompt's embedding, in the final output
    embedding: list[float] | None = None

    def merge(self, newer: RequestOutput) -> None:
        """Fold a later delta into this one (text and ids concatenated, logprobs extended)."""
        mine = {o.index: o for o in self.outputs}
        for out in newer.outputs:
            old = mine.get(out.index)
            if old is None:
                self.outputs.append(out)
                mine[out.index] = out
                continue
            old.text += out.text
            old.token_ids.extend(out.token_ids)
            if out.logprobs is not None:
                old.logprobs = (old.logprobs or []) + out.logprobs
            old.finish_reason = out.finish_reason or old.finish_reason
            old.stop_reason = out.stop_reason if out.stop_reason is not None else old.stop_reason
        self.outputs.sort(key=lambda o: o.index)
        self.finished = self.finished or newer.finished
        self.error = newer.error or self.error
        self.num_cached_tokens = max(self.num_cached_tokens, newer.num_cached_tokens)
        self.metrics.update(newer.metrics)
        self.finished_stats.extend(newer.finished_stats)
        if self.prompt_logprobs is None:
            self.prompt_logprobs = newer.prompt_logprobs
        if self.embedding is None:
            self.embedding = newer.embedding


class RequestOutputCollector:
    """A one-slot mailbox between the engine and one request's consumer.

    The engine ``put``s deltas from the event loop; if the consumer has not taken the pending
    one yet, the new delta is merged into it, so a slow client never grows a queue.
    Consumers read with ``collector.get_nowait() or await collector.get()``.
    """

    def __init__(self) -> None:
        self._output: RequestOutput | BaseException | None = None
        self._waiter: asyncio.Future | None = None  # the consumer's, while it waits

    def put(self, output: RequestOutput | BaseException) -> None:
        if self._output is None or isinstance(output, BaseException):
            self._output = output
        elif isinstance(self._output, RequestOutput):
            self._output.merge(output)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():  # done: the consumer was cancelled
            waiter.set_result(None)

    async def get(self) -> RequestOutput:
        """Wait for the next delta. A bare future, not an ``asyncio.Event``: this runs once
        per token of every stream, and the event's waiter bookkeeping showed in profiles."""
        while self._output is None:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._take()

    def get_nowait(self) -> RequestOutput | None:
        return self._take() if self._output is not None else None

    def _take(self) -> RequestOutput:
        output, self._output = self._output, None
        if isinstance(output, BaseException):
            raise output
        return output
