"""``POST /v1/completions``: one or more prompts, ``n`` choices each (choice index
``prompt_index * n + i``), with ``echo`` and legacy ``logprobs``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from tidal.app.admission import Admitted
from tidal.app.beam_completions import beam_completion
from tidal.app.errors import ApiError
from tidal.app.handling import (
    completion_logprobs,
    generate,
    merge_streams,
    read_request,
    text_advance,
    timed_out,
    timeout_error,
    usage,
)
from tidal.app.metrics import RequestTracker
from tidal.app.prepare import PreparedCompletion, prepare_completion_request
from tidal.app.prompt_logprobs import echoed_entries, prompt_logprobs_json
from tidal.app.server_state import ServerState
from tidal.app.sse import DONE, DeferredJSONResponse, EventStreamResponse, sse_event
from tidal.core.outputs import CompletionOutput, PromptLogprobs, RequestOutput


async def completions(request: Request) -> Any:
    state, prepared = await read_request(request, prepare_completion_request)
    # the sequences it has in the engine at once: ``_Run.deltas`` starts a batch's worth
    n = prepared.params.n
    seqs = min(len(prepared.prompts), _prompts_in_flight(state, n)) * n
    ticket = state.admission.admit(prepared.arrival.client, seqs)  # 429 past its limits
    if prepared.beam is not None:
        return Admitted(DeferredJSONResponse(lambda: beam_completion(state, prepared)), ticket)
    if prepared.stream:
        run = _Run(state, prepared)
        return Admitted(EventStreamResponse(stream_completion(run), on_sent=run.sent), ticket)
    return Admitted(DeferredJSONResponse(lambda: complete_text(state, prepared)), ticket)


def _prompts_in_flight(state: ServerState, n: int) -> int:
    """How many of a request's prompts run at once: a batch's worth of choices."""
    return max(1, state.max_num_seqs // n)


@dataclass
class _Run:
    """The engine requests behind one completion request and their accounting."""

    state: ServerState
    prep: PreparedCompletion
    trackers: list[RequestTracker] = field(default_factory=list)
    cached: dict[int, int] = field(default_factory=dict)  # prompt index -> cached tokens
    generated: int = 0
    expired: bool = False  # a choice ran past the request's timeout

    def __post_init__(self) -> None:
        self.trackers = [self.state.metrics.track(len(p.token_ids)) for p in self.prep.prompts]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prep.prompts)

    def usage(self) -> dict[str, Any]:
        return usage(self.num_prompt_tokens, self.generated, sum(self.cached.values()))

    async def deltas(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        streams = [generate(self.state, self._engine_id(i), p.token_ids, self.prep.params,
                            p.text, self.prep.arrival) for i, p in enumerate(self.prep.prompts)]
        # a batch's worth of choices at a time (``n`` per prompt)
        in_flight = _prompts_in_flight(self.state, self.prep.params.n)
        async for index, out in merge_streams(streams, in_flight):
            self.trackers[index].observe(out)
            self.cached[index] = out.num_cached_tokens
            self.generated += sum(len(c.token_ids) for c in out.outputs)
            self.expired = self.expired or timed_out(out)
            yield index, out

    def finish(self, default_reason: str = "abort") -> None:
        for tracker in self.trackers:
            tracker.finish(self.prep.params.n, default_reason)

    def sent(self) -> None:
        for tracker in self.trackers:
            tracker.sent()

    def choice_index(self, prompt_index: int, comp: CompletionOutput) -> int:
        return prompt_index * self.prep.params.n + comp.index

    def _engine_id(self, prompt_index: int) -> str:
        rid = self.prep.request_id
        return rid if len(self.prep.prompts) == 1 else f"{rid}-p{prompt_index}"


async def stream_completion(run: _Run) -> AsyncIterator[bytes]:
    state, prep = run.state, run.prep
    base = {"id": prep.request_id, "object": "text_completion", "created": prep.created,
            "model": prep.model}
    flags = prep.stream_options
    offsets: dict[int, int] = {}  # choice index -> text offset, for logprobs

    def chunk(choice: dict[str, Any]) -> bytes:
        event = {**base, "choices": [choice]}
        if flags.continuous_usage_stats:
            event["usage"] = run.usage()
        elif flags.include_usage:
            event["usage"] = None
        return sse_event(event)

    def echoes(p_index: int, out: RequestOutput | None) -> list[bytes]:
        """The echoed prompt's chunk of each of its choices, with its scores once known."""
        prompt = prep.prompts[p_index]
        chunks = []
        for i in range(prep.params.n):
            index = p_index * prep.params.n + i
            logprobs = None
            if prep.logprobs is not None:
                entries = echoed_entries(out and out.prompt_logprobs, len(prompt.token_ids))
                logprobs = completion_logprobs(state, prompt.token_ids, entries, prep.logprobs,
                                               0)
            offsets[index] = len(prompt.text)
            chunks.append(chunk({"index": index, "text": prompt.text, "logprobs": logprobs,
                                 "finish_reason": None}))
        return chunks

    # the echo goes first; with logprobs, once the engine has scored that prompt
    echoed = set(range(len(prep.prompts))) if not prep.echo else set()
    if prep.echo and prep.logprobs is None:
        for p_index in range(len(prep.prompts)):
            for event in echoes(p_index, None):
                yield event
            echoed.add(p_index)
    try:
        async for p_index, out in run.deltas():
            if p_index not in echoed:
                echoed.add(p_index)
                for event in echoes(p_index, out):
                    yield event
            for comp in out.outputs:
                if not comp.text and comp.finish_reason is None \
                        and not (prep.logprobs is not None and comp.token_ids):
                    continue
                index = run.choice_index(p_index, comp)
                logprobs = None
                if prep.logprobs is not None:
                    offset = offsets.get(index, 0)
                    logprobs = completion_logprobs(state, comp.token_ids, comp.logprobs or [],
                                                   prep.logprobs, offset)
                    offsets[index] = offset + sum(text_advance(state, t) for t in comp.token_ids)
                yield chunk({"index": index, "text": comp.text, "logprobs": logprobs,
                             "finish_reason": comp.finish_reason})
    except ApiError as err:
        run.finish("error")
        yield sse_event(err.to_dict())
        yield DONE
        return
    finally:
        run.finish()
    if run.expired:
        yield sse_event(timeout_error(prep.timeout).to_dict())
        yield DONE
        return
    if flags.include_usage:
        yield sse_event({**base, "choices": [], "usage": run.usage()})
    yield DONE


async def complete_text(state: ServerState, prep: PreparedCompletion) -> tuple[int, Any]:
    run = _Run(state, prep)
    finals: dict[int, RequestOutput] = {}
    try:
        async for p_index, out in run.deltas():
            if p_index in finals:
                finals[p_index].merge(out)
            else:
                finals[p_index] = out
    except ApiError as err:
        run.finish("error")
        return err.status, err.to_dict()
    finally:
        run.finish()
    choices = []
    for p_index, prompt in enumerate(prep.prompts):
        for comp in finals[p_index].outputs:
            choices.append(_full_choice(state, prep, run.choice_index(p_index, comp), prompt,
                                        comp, finals[p_index].prompt_logprobs))
        if prep.prompt_logprobs is not None:
            for choice in choices[-len(finals[p_index].outputs):]:
                choice["prompt_logprobs"] = prompt_logprobs_json(
                    finals[p_index].prompt_logprobs, prompt.token_ids, prep.prompt_logprobs)
    choices.sort(key=lambda c: c["index"])
    return 200, {"id": prep.request_id, "object": "text_completion", "created": prep.created,
                 "model": prep.model, "choices": choices, "usage": run.usage()}


def _full_choice(state: ServerState, prep: PreparedCompletion, index: int, prompt: Any,
                 comp: CompletionOutput, scores: PromptLogprobs | None) -> dict[str, Any]:
    text = prompt.text + comp.text if prep.echo else comp.text
    logprobs = None
    if prep.logprobs is not None:
        token_ids = list(comp.token_ids)
        entries: list[dict[int, float] | None] = list(comp.logprobs or [])
        if prep.echo:
            token_ids = prompt.token_ids + token_ids
            entries = echoed_entries(scores, len(prompt.token_ids)) + entries
        logprobs = completion_logprobs(state, token_ids, entries, prep.logprobs, 0)
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": comp.finish_reason}
