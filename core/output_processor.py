"""Turns the scheduler's per-request updates into ``RequestOutput`` deltas: incremental
detokenization, stop strings, and the merging of ``n`` sibling sequences into one output."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tidal.core.detokenizer import DetokenizationError, IncrementalDetokenizer
from tidal.core.lifecycle import TIMEOUT, RequestStats
from tidal.core.outputs import CompletionOutput, RequestOutput
from tidal.core.request import Request, RequestStatus
from tidal.core.scheduler_update import RequestUpdate

StopFn = Callable[[Request, RequestStatus, "str | None"], None]


@dataclass
class ParentRequest:
    """A user request: ``n`` sibling sequences sharing one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: dict[str, int]  # child request id -> choice index
    arrival_time: float = field(default_factory=time.monotonic)
    num_finished: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs_sent: bool = False  # once, from the first child whose prompt is scored


@dataclass
class ChildState:
    parent: ParentRequest
    index: int
    detokenizer: IncrementalDetokenizer | None  # None: ids only (``detokenize=False``)
    wants_logprobs: bool


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentRequest] = {}
        self.children: dict[str, ChildState] = {}

    def add(self, parent: ParentRequest, children: list[Request]) -> None:
        self.parents[parent.request_id] = parent
        for child in children:
            params = child.sampling_params
            detok = (IncrementalDetokenizer(self.tokenizer, child.prompt_token_ids, params)
                     if params.detokenize else None)
            self.children[child.request_id] = ChildState(
                parent, parent.children[child.request_id], detok,
                params.logprobs is not None)

    def child_ids(self, parent_id: str) -> list[str]:
        parent = self.parents.get(parent_id)
        return list(parent.children) if parent else []

    def process(self, updates: list[RequestUpdate], finished_elsewhere: list[Request],
                stop: StopFn) -> list[RequestOutput]:
        """Build the step's deltas. ``stop`` finishes a request whose text hit a stop string
        or could not be detokenized."""
        by_parent: dict[str, RequestOutput] = {}
        for update in updates:
            child = self.children.get(update.request.request_id)
            if child is not None:
                completion = self._completion(update, child, stop)
                self._add_to(by_parent, child.parent, update.request, completion)
        for request in finished_elsewhere:
            child = self.children.get(request.request_id)
            if child is not None:
                completion = CompletionOutput(index=child.index)
                self._finish_child(request, completion)
                self._add_to(by_parent, child.parent, request, completion)
        return list(by_parent.values())

    def _completion(self, update: RequestUpdate, child: ChildState,
                    stop: StopFn) -> CompletionOutput:
        request = update.request
        stop_str, text = self._text(update, child.detokenizer, stop)
        if stop_str is not None:
            _finish(request, RequestStatus.FINISHED_STOPPED, stop_str, stop)
        # the update's list is the scheduler's fresh one for this step: no copy needed
        completion = CompletionOutput(child.index, text, update.new_token_ids)
        if child.wants_logprobs:
            completion.logprobs = list(update.new_logprobs or [])
        if request.is_finished:
            self._finish_child(request, completion)
        return completion

    @staticmethod
    def _text(update: RequestUpdate, detokenizer: IncrementalDetokenizer | None,
              stop: StopFn) -> tuple[str | None, str]:
        """The stop string the new tokens completed (or None) and their final text."""
        if detokenizer is None:
            return None, ""
        token_ids = update.new_token_ids
        if (update.finished and update.request.status == RequestStatus.FINISHED_STOPPED
                and not detokenizer.include_stop):
            token_ids = token_ids[:-1]  # ended by EOS or a stop id, whose text is left out
        try:
            return detokenizer.update_and_get_delta(token_ids, update.finished)
        except DetokenizationError as exc:
            update.request.error = str(exc)
            _finish(update.request, RequestStatus.FINISHED_ERROR, None, stop)
            return None, detokenizer.get_delta()

    def _finish_child(self, request: Request, completion: CompletionOutput) -> None:
        completion.finish_reason = request.finish_reason
        completion.stop_reason = request.stop_reason
        child = self.children.pop(request.request_id)
        child.parent.num_finished += 1

    def _add_to(self, by_parent: dict[str, RequestOutput], parent: ParentRequest,
                request: Request, completion: CompletionOutput) -> None:
        out = by_parent.get(parent.request_id)
        if out is None:
            if request.num_cached_tokens > parent.num_cached_tokens:
                parent.num_cached_tokens = request.num_cached_tokens
            out = RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, [],
                                False, parent.num_cached_tokens)
            by_parent[parent.request_id] = out
        out.outputs.append(completion)
        scores = request.prompt_scores
        if scores is not None and scores.complete and not parent.prompt_logprobs_sent:
            parent.prompt_logprobs_sent = True
            out.prompt_logprobs = scores.as_vllm(
                self._token_text if request.sampling_params.detokenize else None)
        if request.pooled is not None:
            out.embedding = request.pooled
        if completion.finish_reason is not None:
            out.finished_stats.append(request_stats(request))
        if request.error:
            out.error = request.error
        if parent.num_finished == len(parent.children):
            out.finished = True
            del self.parents[parent.request_id]

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def request_stats(request: Request) -> RequestStats:
    times = request.times
    if times.finished is None:  # refused before it was queued
        times.finished = time.monotonic()
    reason = request.finish_reason
    return RequestStats(request.request_id, reason, times, request.num_prompt_tokens,
                        request.num_output_tokens, max(request.num_cached_tokens, 0),
                        request.num_preemptions,
                        timed_out=reason == "abort" and request.stop_reason == TIMEOUT)


def _finish(request: Request, status: RequestStatus, reason: str | None, stop: StopFn) -> None:
    """Finish ``request`` for its text. One the scheduler finished in this same step (for
    length or EOS) keeps its freed blocks and only takes the text's status and reason."""
    stop(request, status, reason)
    request.status = status
    request.stop_reason = reason
