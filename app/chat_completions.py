"""``POST /v1/chat/completions``: streamed as SSE chunks or answered as one JSON object."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from tidal.app.admission import Admitted
from tidal.app.chat_reply import ReplyDeltas, whole_message
from tidal.app.errors import ApiError
from tidal.app.handling import (
    chat_logprobs,
    generate,
    read_request,
    timed_out,
    timeout_error,
    usage,
)
from tidal.app.metrics import RequestTracker
from tidal.app.prepare import PreparedRequest, prepare_chat_request
from tidal.app.prompt_logprobs import prompt_logprobs_json
from tidal.app.server_state import ServerState
from tidal.app.sse import DONE, DeferredJSONResponse, EventStreamResponse, sse_event
from tidal.core.outputs import CompletionOutput, RequestOutput


async def chat_completions(request: Request) -> Any:
    state, prepared = await read_request(request, prepare_chat_request)
    ticket = state.admission.admit(prepared.arrival.client, prepared.params.n)  # else 429
    if prepared.stream:
        tracker = state.metrics.track(len(prepared.prompt_token_ids))
        return Admitted(EventStreamResponse(stream_chat(state, prepared, tracker),
                                            on_sent=tracker.sent), ticket)
    return Admitted(DeferredJSONResponse(lambda: complete_chat(state, prepared)), ticket)


async def stream_chat(state: ServerState, prep: PreparedRequest, tracker: RequestTracker
                      ) -> AsyncIterator[bytes]:
    """The SSE events of one chat request, ``data: [DONE]`` included."""
    n = prep.params.n
    base = {"id": prep.request_id, "object": "chat.completion.chunk", "created": prep.created,
            "model": prep.model}
    flags = prep.stream_options
    num_prompt = len(prep.prompt_token_ids)
    generated, cached = 0, 0

    def chunk(choice: dict[str, Any]) -> bytes:
        event = {**base, "choices": [choice]}
        if flags.continuous_usage_stats:
            event["usage"] = usage(num_prompt, generated, cached)
        elif flags.include_usage:
            event["usage"] = None
        return sse_event(event)

    replies = [ReplyDeltas(prep.tool_use, prep.reasoning) for _ in range(n)]
    for index in range(n):
        yield chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None})
    expired = False
    try:
        async for out in generate(state, prep.request_id, prep.prompt_token_ids, prep.params,
                                  prep.prompt, prep.arrival):
            tracker.observe(out)
            expired = expired or timed_out(out)
            cached = out.num_cached_tokens
            for comp in out.outputs:
                generated += len(comp.token_ids)
                choice = _delta_choice(state, prep, comp, replies[comp.index])
                if choice is not None:
                    yield chunk(choice)
    except ApiError as err:
        tracker.finish(n, "error")
        yield sse_event(err.to_dict())
        yield DONE
        return
    finally:
        tracker.finish(n)
    if expired:
        yield sse_event(timeout_error(prep.timeout).to_dict())
        yield DONE
        return
    if flags.include_usage:
        yield sse_event({**base, "choices": [], "usage": usage(num_prompt, generated, cached)})
    yield DONE


def _delta_choice(state: ServerState, prep: PreparedRequest, comp: CompletionOutput,
                  deltas: ReplyDeltas) -> dict[str, Any] | None:
    delta, finish_reason = deltas.feed(comp.text, comp.finish_reason)
    if not delta and finish_reason is None and not (prep.logprobs and comp.token_ids):
        return None
    logprobs = None
    if prep.logprobs:
        logprobs = chat_logprobs(state, comp.token_ids, comp.logprobs, prep.top_logprobs)
    return {"index": comp.index, "delta": delta, "logprobs": logprobs,
            "finish_reason": finish_reason}


async def complete_chat(state: ServerState, prep: PreparedRequest) -> tuple[int, Any]:
    """The whole non-streamed response as ``(status, payload)``."""
    n = prep.params.n
    tracker = state.metrics.track(len(prep.prompt_token_ids))
    final: RequestOutput | None = None
    try:
        async for out in generate(state, prep.request_id, prep.prompt_token_ids, prep.params,
                                  prep.prompt, prep.arrival):
            tracker.observe(out)
            if final is None:
                final = out
            else:
                final.merge(out)
    except ApiError as err:
        tracker.finish(n, "error")
        return err.status, err.to_dict()
    finally:
        tracker.finish(n)
    assert final is not None  # generate yields until the request finishes
    choices = []
    for comp in final.outputs:
        logprobs = None
        if prep.logprobs:
            logprobs = chat_logprobs(state, comp.token_ids, comp.logprobs, prep.top_logprobs)
        message, finish_reason = whole_message(prep.tool_use, prep.reasoning, comp.text,
                                               comp.finish_reason)
        choices.append({"index": comp.index, "message": message, "logprobs": logprobs,
                        "finish_reason": finish_reason})
    generated = sum(len(c.token_ids) for c in final.outputs)
    reply = {
        "id": prep.request_id, "object": "chat.completion", "created": prep.created,
        "model": prep.model, "choices": choices,
        "usage": usage(len(prep.prompt_token_ids), generated, final.num_cached_tokens)}
    if prep.prompt_logprobs is not None:
        reply["prompt_logprobs"] = prompt_logprobs_json(
            final.prompt_logprobs, prep.prompt_token_ids, prep.prompt_logprobs)
    return 200, reply
