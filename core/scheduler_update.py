"""The scheduler's side after a forward: a step's sampled tokens appended to their requests,
one at a time with the stop checks after each (EOS, stop token ids, max_tokens, a finished
grammar), and speculative proposals the target rejected taken back. A part of ``Scheduler``,
kept apart so that each part reads on its own."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tidal.core.outputs import TokenLogprobs
from tidal.core.prompt_logprobs import add_prompt_chunks
from tidal.core.request import Request, RequestStatus
from tidal.core.scheduler_output import ModelRunnerOutput

if TYPE_CHECKING:
    from tidal.core.spec_decode import Speculator
    from tidal.core.structured_output.manager import StructuredOutputManager


@dataclass
class RequestUpdate:
    """What one step did to one request: tokens appended, and whether it finished."""

    request: Request
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None
    finished: bool


class StepUpdates:
    requests: dict[str, Request]
    structured: StructuredOutputManager | None
    speculator: Speculator | None
    _dequeue: Callable[[Request], None]  # the scheduler's: out of running or waiting
    _finish: Callable[[Request, RequestStatus], None]  # the scheduler's: frees its KV

    # -- after the forward --------------------------------------------------------------
    def update_from_output(self, output: ModelRunnerOutput) -> list[RequestUpdate]:
        updates = []
        requests = self.requests
        logprobs = output.logprobs
        now = time.monotonic()
        if output.prompt_logprobs:
            add_prompt_chunks(requests, output.prompt_logprobs)
        for req_id, embedding in (output.pooled or {}).items():
            request = requests.get(req_id)
            if request is not None:  # pooled: its one prefill done (core/pooling.py)
                request.pooled = embedding
                self._dequeue(request)
                self._finish(request, RequestStatus.FINISHED_STOPPED)
                updates.append(RequestUpdate(request, [], None, True))
        for i, (req_id, token_ids) in enumerate(zip(output.req_ids, output.sampled_token_ids)):
            request = requests.get(req_id)  # only unfinished requests are in it
            if request is None:
                continue  # finished (aborted, say) while the step ran
            if request.num_output_placeholders:
                request.num_output_placeholders -= 1
            if request.max_output_tokens == 0:  # its prompt scored: done, the token dropped
                self._dequeue(request)
                self._finish(request, RequestStatus.FINISHED_LENGTH_CAPPED)
                updates.append(RequestUpdate(request, [], None, True))
                continue
            if self.speculator is not None:
                self.speculator.settle(request, len(token_ids))
            times = request.times
            if times.first_token is None:
                times.first_token = now
            times.last_token = now
            kept, finished = self._append_tokens(request, token_ids)
            new_logprobs = None if logprobs is None else logprobs[i]
            if kept < len(token_ids):  # a stop inside an accepted run: the rest is dropped
                token_ids = token_ids[:kept]
                new_logprobs = None if new_logprobs is None else new_logprobs[:kept]
            updates.append(RequestUpdate(request, token_ids, new_logprobs, finished))
            drafts = output.draft_token_ids and output.draft_token_ids.get(req_id)
            if drafts and not finished and self.speculator is not None:
                self.speculator.drafted(request, drafts)
        return updates

    def _append_tokens(self, request: Request, token_ids: list[int]) -> tuple[int, bool]:
        """Append a step's tokens to ``request`` one by one, checking for a stop after each;
        returns how many were kept (those after a stop are dropped) and whether it finished."""
        structured = self.structured
        for kept, token_id in enumerate(token_ids, 1):
            request.append_output_token(token_id)
            grammar_done = structured is not None and structured.accept(request.request_id,
                                                                        token_id)
            if (grammar_done or token_id in request.stop_token_set
                    or request.num_output_tokens >= request.max_output_tokens):
                status = self._stop_status(request, token_id) or (
                    RequestStatus.FINISHED_STOPPED if grammar_done else None)
                if status is not None:
                    self._dequeue(request)
                    self._finish(request, status)
                    return kept, True
        return len(token_ids), False

    @staticmethod
    def _stop_status(request: Request, token_id: int) -> RequestStatus | None:
        """Why ``request`` stops after its newest token ``token_id``, if it does."""
        params = request.sampling_params
        if (token_id in request.stop_token_set
                and request.num_output_tokens >= params.min_tokens):
            if token_id != request.eos_token_id or params.ignore_eos:
                request.stop_reason = token_id  # a stop token id, not EOS
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_output_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

