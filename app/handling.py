"""What the chat and text-completion handlers share: reading the request (API key, size limit,
JSON, validation), driving the engine with errors mapped to ``ApiError``, merging several
prompts' streams, and the usage and logprobs blocks of the responses."""

from __future__ import annotations

import asyncio
import functools
import hmac
import itertools
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, TypeVar

from starlette.requests import Request

from tidal.app.admission import client_key
from tidal.app.body_screen import LARGE_BODY_BYTES, parse_json_body, raise_refusal, screen
from tidal.app.errors import ApiError
from tidal.app.guard import CLOSE
from tidal.app.refusals import refusal_key
from tidal.app.server_state import ServerState
from tidal.core.async_engine import EngineDeadError
from tidal.core.lifecycle import TIMEOUT, Arrival
from tidal.core.outputs import RequestOutput
from tidal.core.sampling_params import SamplingParams
from tidal.core.structured_output.compiler import GrammarError

Prepared = TypeVar("Prepared")


def get_state(request: Request) -> ServerState:
    return request.app.state.tidal


def check_api_key(headers: Mapping[str, str], state: ServerState) -> None:
    """401 unless ``Authorization: Bearer <key>`` matches ``--api-key`` (when one is set)."""
    key = state.settings.api_key
    if not key:
        return
    given = headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                             key.encode()):
        raise ApiError(401, "Invalid or missing API key: send `Authorization: Bearer <key>`",
                       code="invalid_api_key")


def check_engine(state: ServerState) -> None:
    if not state.engine.is_alive:
        raise ApiError(503, f"The engine is not running: {state.engine.error or 'stopped'}",
                       code="engine_dead")


async def read_body(request: Request) -> bytes:
    """Authorize, then read the body's bytes, at most ``max_request_bytes`` (else 413)."""
    state = get_state(request)
    check_api_key(request.headers, state)
    limit = state.settings.max_request_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)  # past the limit, drain the rest so the reply gets through
    if size > limit:
        raise _too_large(limit)
    return b"".join(chunks)


async def read_request(request: Request,
                       prepare: Callable[[dict[str, Any], ServerState], Prepared]
                       ) -> tuple[ServerState, Prepared]:
    """Read the body and ``prepare`` it for the engine, then check the engine is running:
    a request that is wrong gets its 4xx even while the engine is down. Stamps the
    prepared request's ``arrival``: when it came, when its prompt was tokenized, its
    timeout and its client (``admission.client_key``).

    Parsing, validation, templating, tokenizing and the grammar's size checks and key all
    grow with the body: they run on the state's ``prepare_pool``, never on the event loop,
    and not at all for a client that admission would refuse whatever its request holds.
    The grammar then compiles within the request's ``timeout``."""
    arrived = time.monotonic()
    state = get_state(request)
    share_by = state.settings.fair_share_by
    await state.refusals.hold(refusal_key(share_by, request.scope, request.headers))
    if share_by != "user":  # the client is known before the body is read: 429 at once
        try:
            state.admission.check_room(client_key(share_by, request.scope, request.headers, {}))
        except ApiError as exc:  # its body is left unread: the connection cannot go on
            exc.headers = {**(exc.headers or {}), **CLOSE}
            raise
    raw = await read_body(request)
    if len(raw) > LARGE_BODY_BYTES:  # the caps on its objects, checked in another process
        settings = state.settings
        raise_refusal(await asyncio.get_running_loop().run_in_executor(
            state.screen_pool, screen, raw, settings.max_prompts_per_request,
            settings.max_tools))
    prepared = await prepare_off_loop(
        state, arrived, functools.partial(_parse_and_prepare, raw, prepare, state),
        lambda body: client_key(state.settings.fair_share_by, request.scope, request.headers,
                                body))
    return state, prepared


async def prepare_off_loop(state: ServerState, arrived: float,
                           work: Callable[[], tuple[Mapping[str, Any], Prepared]],
                           client_of: Callable[[Mapping[str, Any]], str]) -> Prepared:
    """Run ``work`` (parse, validate, template, tokenize: returns the body and the prepared
    request) on the ``prepare_pool``, stamp the prepared request's ``arrival`` (``arrived``,
    its tokenizing, its timeout, ``client_of(body)``), then check the engine is running and
    the request's grammar compiles: what every chat and completion request, HTTP or
    websocket turn, goes through before admission."""
    loop = asyncio.get_running_loop()
    body, prepared = await loop.run_in_executor(state.prepare_pool, work)
    timeout = prepared.timeout  # type: ignore[attr-defined]
    prepared.arrival = Arrival(arrived, time.monotonic(), timeout,  # type: ignore[attr-defined]
                               client_of(body), prepared.priority)  # type: ignore[attr-defined]
    check_engine(state)
    await check_grammar(state, prepared.params, prepared.arrival)  # type: ignore[attr-defined]
    return prepared


def _parse_and_prepare(raw: bytes, prepare: Callable[[dict[str, Any], ServerState], Prepared],
                       state: ServerState) -> tuple[dict[str, Any], Prepared]:
    body = parse_json_body(raw)
    return body, prepare(body, state)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"The request body is larger than the limit of {limit} bytes",
                    code="request_too_large")


async def check_grammar(state: ServerState, params: SamplingParams,
                        arrival: Arrival | None = None) -> None:
    """400 naming the field when the request's reply constraint does not compile (or takes
    longer than the server's compile limit); checked before a response starts, so a stream
    never opens for it. The compile counts against the request's ``timeout`` (``arrival``):
    past it, 408."""
    spec = params.structured_outputs
    if spec is None:
        return
    deadline = arrival.deadline if arrival is not None else None
    client = arrival.client if arrival is not None else ""

    async def compile_in_turn() -> None:  # one compile at a time per client (compile_gate.py)
        async with state.compile_gate.turn(client):
            await state.engine.compile_grammar(spec)

    try:
        if deadline is None:
            await compile_in_turn()
        else:  # the shared compile goes on (it is cached) when this request stops waiting
            await asyncio.wait_for(compile_in_turn(), max(0.0, deadline - time.monotonic()))
    except GrammarError as exc:
        raise ApiError(400, str(exc), exc.param, code=exc.code) from None
    except asyncio.TimeoutError:
        assert arrival is not None
        raise timeout_error(arrival.timeout) from None


async def generate(state: ServerState, request_id: str, prompt_token_ids: list[int],
                   params: SamplingParams, prompt: str | None,
                   arrival: Arrival | None = None) -> AsyncIterator[RequestOutput]:
    """``AsyncEngine.generate`` with its failures as ``ApiError``s: 503 when the engine is
    dead, 400 when it refuses the request, 500 when the request ends in an error."""
    try:
        async for out in state.engine.generate(prompt_token_ids, params, request_id, prompt,
                                               arrival):
            if out.error or any(c.finish_reason == "error" for c in out.outputs):
                raise ApiError(500, f"The request failed: {out.error or 'engine error'}")
            yield out
    except EngineDeadError as exc:
        raise ApiError(503, f"The engine is not running: {exc}", code="engine_dead") from None
    except ValueError as exc:
        raise ApiError(400, str(exc), "prompt") from None


async def merge_streams(streams: list[AsyncIterator[RequestOutput]], max_in_flight: int
                        ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several prompts' delta streams as ``(prompt_index, delta)``.

    Each stream is pumped by a task through a small bounded queue, so a slow consumer leaves
    deltas merging in the engine's collectors. At most ``max_in_flight`` streams run at once,
    the next starting as one ends: a request of many prompts then queues in the engine a batch
    at a time, and a request arriving after it waits for one batch, not for all of them.
    Leaving early cancels every pump, which aborts every request."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((index, out, None))
            await queue.put((index, None, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, None, exc))

    waiting = iter(enumerate(streams))
    tasks = [asyncio.create_task(pump(i, s))
             for i, s in itertools.islice(waiting, max(1, max_in_flight))]
    try:
        remaining = len(streams)
        while remaining:
            index, out, exc = await queue.get()
            if exc is not None:
                raise exc
            if out is None:
                remaining -= 1
                tasks.extend(asyncio.create_task(pump(i, s))
                             for i, s in itertools.islice(waiting, 1))
                continue
            yield index, out
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def timed_out(out: RequestOutput) -> bool:
    """Whether a choice of ``out`` was aborted for running past the request's timeout."""
    return any(c.finish_reason == "abort" and c.stop_reason == TIMEOUT for c in out.outputs)


def timeout_error(timeout: float | None) -> ApiError:
    """What a stream sends, before ``[DONE]``, when its request ran past its timeout."""
    return ApiError(408, f"The request ran past its timeout of {timeout:g} s and was aborted",
                    "timeout", type="timeout_error", code="request_timeout")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def sorted_top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def chat_logprobs(state: ServerState, token_ids: list[int],
                  logprobs: list[dict[int, float]] | None, top: int) -> dict[str, Any]:
    """The chat ``logprobs`` block: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for token_id, entry in zip(token_ids, logprobs or []):
        content.append({**_token_info(state, token_id, entry.get(token_id, float("-inf"))),
                        "top_logprobs": [_token_info(state, t, lp)
                                         for t, lp in sorted_top(entry, top)]})
    return {"content": content}


def _token_info(state: ServerState, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": state.token_text(token_id), "logprob": logprob,
            "bytes": list(state.token_bytes(token_id))}


def text_advance(state: ServerState, token_id: int) -> int:
    """How far a token moves ``text_offset``: the characters whose first byte it holds, so
    the bytes of one character spread over several tokens count once (their texts are each
    U+FFFD)."""
    return sum(1 for b in state.token_bytes(token_id) if b & 0xC0 != 0x80)


def completion_logprobs(state: ServerState, token_ids: list[int],
                        logprobs: list[dict[int, float] | None], top: int,
                        text_offset: int) -> dict[str, Any]:
    """The legacy completions ``logprobs`` block; ``None`` entries (echoed prompt tokens,
    whose logprobs the engine does not compute) give ``null`` values."""
    tokens, values, tops, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, logprobs):
        text = state.token_text(token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += text_advance(state, token_id)
        if entry is None:
            values.append(None)
            tops.append(None)
            continue
        value = entry.get(token_id, float("-inf"))
        values.append(value)
        # the sampled token always among them, as OpenAI's and vLLM's: up to ``top`` + 1
        top_entries = dict(sorted_top(entry, top)) | {token_id: value}
        texts: dict[str, float] = {}
        for t, lp in top_entries.items():  # tokens of the same text: the likeliest's
            text = state.token_text(t)
            texts[text] = max(lp, texts.get(text, lp))
        tops.append(texts)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}
