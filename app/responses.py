"""``POST /v1/responses`` (streamed as typed SSE events or answered whole), and ``GET`` and
``DELETE /v1/responses/{id}`` over the server's stored responses (``app/response_store.py``).

A request is read, admitted and run as a chat request is (``app/handling.py``,
``app/admission.py``); ``app/responses_request.py`` translates it into one and
``app/responses_output.py`` turns the reply into output items and events.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from tidal.app.admission import Admitted
from tidal.app.errors import ApiError
from tidal.app.handling import (
    check_api_key,
    generate,
    get_state,
    read_request,
    timed_out,
    timeout_error,
)
from tidal.app.metrics import RequestTracker
from tidal.app.responses_input import input_messages
from tidal.app.responses_output import Event, ResponseBuilder, response_usage
from tidal.app.responses_request import PreparedResponse, prepare_response_request, renamed_errors
from tidal.app.server_state import ServerState
from tidal.app.sse import DeferredJSONResponse, EventStreamResponse, named_sse_event


async def create_response(request: Request) -> Any:
    with renamed_errors():  # the grammar's compile, after preparing, may name a chat field
        state, prep = await read_request(request, prepare_response_request)
    ticket = state.admission.admit(prep.arrival.client, 1)  # else 429
    if prep.stream:
        tracker = state.metrics.track(len(prep.chat.prompt_token_ids))
        return Admitted(EventStreamResponse(stream_response(state, prep, tracker),
                                            on_sent=tracker.sent), ticket)
    return Admitted(DeferredJSONResponse(lambda: complete_response(state, prep)), ticket)


async def get_response(request: Request) -> JSONResponse:
    state = get_state(request)
    check_api_key(request.headers, state)
    stored = state.responses.get(request.path_params["response_id"])
    if stored is None:
        raise _not_found(request.path_params["response_id"])
    return JSONResponse(stored.response)


async def delete_response(request: Request) -> JSONResponse:
    state = get_state(request)
    check_api_key(request.headers, state)
    response_id = request.path_params["response_id"]
    if not state.responses.delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"No response with id {response_id!r} is stored", "response_id",
                    code="response_not_found")


async def stream_response(state: ServerState, prep: PreparedResponse, tracker: RequestTracker
                          ) -> AsyncIterator[bytes]:
    """The typed SSE events of one response; a failure ends the stream with
    ``response.failed``."""
    builder = ResponseBuilder(prep)
    try:
        async for event in _run(state, prep, builder, tracker):
            yield named_sse_event(event["type"], event)
    except ApiError as err:
        failed = builder.failed(err.message, _usage(state, prep, builder))
        _store(state, prep, failed["response"])
        yield named_sse_event(failed["type"], failed)


async def complete_response(state: ServerState, prep: PreparedResponse) -> tuple[int, Any]:
    """The whole response as ``(status, payload)``: the same run, its events left unsent."""
    tracker = state.metrics.track(len(prep.chat.prompt_token_ids))
    final: Event = {}
    try:
        async for event in _run(state, prep, ResponseBuilder(prep), tracker):
            final = event  # the last: response.completed or response.incomplete
    except ApiError as err:
        return err.status, err.to_dict()
    return 200, final["response"]


async def _run(state: ServerState, prep: PreparedResponse, builder: ResponseBuilder,
               tracker: RequestTracker) -> AsyncIterator[Event]:
    """Every event of the response, the last once it is stored; ``ApiError`` where the
    generation fails or runs past its timeout."""
    chat = prep.chat
    for event in builder.start():
        yield event
    expired = False
    try:
        async for out in generate(state, chat.request_id, chat.prompt_token_ids, chat.params,
                                  chat.prompt, chat.arrival):
            tracker.observe(out)
            expired = expired or timed_out(out)
            builder.cached_tokens = out.num_cached_tokens
            for comp in out.outputs:
                builder.output_tokens += len(comp.token_ids)
                for event in builder.feed(comp.text, comp.finish_reason):
                    yield event
    except ApiError:
        tracker.finish(1, "error")
        raise
    finally:
        tracker.finish(1)
    if expired:
        raise timeout_error(chat.timeout)
    events = builder.finish(_usage(state, prep, builder))
    _store(state, prep, events[-1]["response"])
    for event in events:
        yield event


def _usage(state: ServerState, prep: PreparedResponse, builder: ResponseBuilder
           ) -> dict[str, Any]:
    """Usage; ``reasoning_tokens`` counts the thinking's text as the tokenizer spells it."""
    reasoning = len(state.tokenizer.encode(builder.reasoning, add_special_tokens=False)) \
        if builder.reasoning else 0
    return response_usage(len(prep.chat.prompt_token_ids), builder.output_tokens,
                          builder.cached_tokens, reasoning)


def _store(state: ServerState, prep: PreparedResponse, response: dict[str, Any]) -> None:
    """Keep the response, and its conversation for a follow-up, unless ``store`` is false."""
    if prep.store:
        output = input_messages(response["output"]) if response["status"] != "failed" else []
        state.responses.put(response, prep.conversation + output)

