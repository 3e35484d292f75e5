"""The websocket chat at ``/v1/chat/ws`` and the web chat page at ``/``.

Frame protocol (JSON text frames; docs/api.md's "The websocket chat" section has the details):

- client -> server: an OpenAI chat request (``messages``, ``max_tokens``, ``temperature``, ...;
  ``model`` may be left out) optionally tagged ``"type": "chat"``, or ``{"type": "cancel"}``.
  ``"truncation": "auto"`` (as in OpenAI's Responses API; the default is ``"disabled"``) lets a
  conversation too long for the context lose its oldest turns instead of failing.
- server -> client, per turn: ``{"type": "delta", "id", "index", "text", "num_tokens"}`` frames
  (``text``: the answer; with a reasoning parser, ``"reasoning"``: the thinking; with tools,
  ``"tool_calls"``: fragments as in the chat API's ``delta.tool_calls``), then exactly one
  terminal frame: ``{"type": "done", "id", "model", "finish_reason",
  "choices", "usage"}`` (plus ``"dropped_messages"`` with truncation) or ``{"type": "error",
  "id", "error": {...}}``.

One turn runs at a time per socket, as its own task, so the reader keeps reading frames (a
cancel, or the socket closing) while the turn is prepared and its reply streams. A cancel frame
aborts the request in the engine, which ends the turn with ``finish_reason: "abort"``; a closed
socket cancels the turn's task, and leaving ``AsyncEngine.generate`` early aborts the request
and frees its KV blocks.

A turn goes the HTTP chat's way (``handling.prepare_off_loop``): validated, templated,
tokenized and its grammar checked on the ``prepare_pool``, never on the event loop (nor is a
large frame parsed there), stamped with its client (``admission.client_key``: the peer
address, the key presented in the header or the subprotocol, or the frame's ``user``), then
admitted (``ServerState.admission``) or refused with a 429 error frame carrying
``retry_after``; its reservation is given back when the turn ends, however it ends, before
its terminal frame leaves.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import functools
import hmac
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson
from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from tidal.app.admission import bearer_token, client_key
from tidal.app.chat_reply import ReplyDeltas
from tidal.app.errors import ApiError, bad_request
from tidal.app.handling import (
    chat_logprobs,
    generate,
    prepare_off_loop,
    timed_out,
    timeout_error,
    usage,
)
from tidal.app.metrics import RequestTracker
from tidal.app.prepare import PreparedRequest, prepare_chat_request
from tidal.app.server_state import ServerState
from tidal.core.outputs import CompletionOutput
from tidal.templates import TEMPLATES_DIR

logger = logging.getLogger(__name__)

WS_PATH = "/v1/chat/ws"
# Frames up to this size are parsed on the event loop (a cancel frame must not queue behind other
# clients' bodies on the prepare pool); larger ones on the pool (4 MiB of JSON takes ~50 ms).
PARSE_ON_LOOP_BYTES = 64 << 10
_page_env = Environment(loader=FileSystemLoader(TEMPLATES_DIR),
                        autoescape=select_autoescape(["html"]))


async def chat_page(request: Request) -> Response:
    """The web chat page; it talks to the websocket below."""
    state = request.app.state.tidal
    html = _page_env.get_template("chat.html").render(
        model=state.served_model_name, ws_path=WS_PATH, context_tokens=state.context_tokens)
    return HTMLResponse(html)


async def chat_websocket(websocket: WebSocket) -> None:
    offered = websocket.scope.get("subprotocols") or []
    await websocket.accept(subprotocol=PAGE_PROTOCOL if PAGE_PROTOCOL in offered else None)
    state = websocket.app.state.tidal
    socket = ChatSocket(websocket, state)
    if not _authorized(websocket, state.settings.api_key):
        await socket.send_error(ApiError(401, "a valid API key is required: send it as "
                                         "'Authorization: Bearer <key>' or in the subprotocol "
                                         f"'{KEY_PROTOCOL}<base64url of the key>'",
                                         code="invalid_api_key"))
        await websocket.close(code=1008)  # policy violation
        return
    await socket.serve()


# Browsers cannot set headers on a websocket, so the page sends the key as a subprotocol it
# offers beside ``tidal`` (the one the server picks, so the key is never echoed): never in the
# URL, which logs and proxies keep.
PAGE_PROTOCOL = "tidal"
KEY_PROTOCOL = "tidal-key."


def key_protocol(key: str) -> str:
    """The subprotocol that carries ``key``: ``tidal-key.`` and its UTF-8 in unpadded
    base64url (a subprotocol is an HTTP token, which a key's ``/`` or ``=`` would break)."""
    return KEY_PROTOCOL + base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


def _authorized(websocket: WebSocket, api_key: str | None) -> bool:
    """The key from ``Authorization: Bearer`` or the ``tidal-key.`` subprotocol."""
    if not api_key:
        return True
    given = presented_key(websocket)
    return bool(given) and hmac.compare_digest(given.encode(), api_key.encode())


def presented_key(websocket: WebSocket) -> str:
    """The key the client presented: ``Authorization: Bearer <key>``, else the first
    ``tidal-key.`` subprotocol decoded; "" without one (or one that does not decode)."""
    token = bearer_token(websocket.headers)
    if token:
        return token
    for protocol in websocket.scope.get("subprotocols") or []:
        if protocol.startswith(KEY_PROTOCOL):
            encoded = protocol[len(KEY_PROTOCOL):]
            try:
                return base64.b64decode(encoded + "=" * (-len(encoded) % 4), altchars=b"-_",
                                        validate=True).decode()
            except (binascii.Error, UnicodeDecodeError):
                return ""
    return ""


@dataclass
class Turn:
    """One request/reply exchange on a socket."""

    id: str
    cancelled: bool = False
    finish_reasons: dict[int, str] = field(default_factory=dict)
    num_tokens: int = 0
    num_cached_tokens: int = 0
    replies: list[ReplyDeltas] = field(default_factory=list)  # each choice's parts


class ChatSocket:
    """Reads frames and runs one turn at a time on one accepted websocket."""

    def __init__(self, websocket: WebSocket, state: ServerState) -> None:
        self.ws = websocket
        self.state = state
        self.turn: Turn | None = None
        self._task: asyncio.Task | None = None  # the latest turn's task
        self._send_lock = asyncio.Lock()
        self._key = presented_key(websocket)  # who its turns count as, by --fair-share-by

    async def serve(self) -> None:
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                await self._on_frame(message.get("text") or message.get("bytes") or b"")
        except WebSocketDisconnect:
            return
        finally:
            await self._drop_turn()

    async def _on_frame(self, raw: str | bytes) -> None:
        limit = self.state.settings.max_request_bytes
        size = len(raw if isinstance(raw, bytes) else raw.encode())
        if size > limit:
            await self.send_error(ApiError(413, f"the frame is larger than the limit of {limit}"
                                           " bytes", code="request_too_large"))
            return
        try:
            if size <= PARSE_ON_LOOP_BYTES:
                frame = orjson.loads(raw)
            else:
                frame = await asyncio.get_running_loop().run_in_executor(
                    self.state.prepare_pool, orjson.loads, raw)
        except orjson.JSONDecodeError as exc:
            await self.send_error(_bad_frame(f"the frame is not valid JSON: {exc}"))
            return
        if not isinstance(frame, dict):
            await self.send_error(_bad_frame("a frame must be a JSON object"))
            return
        kind = frame.pop("type", "chat")
        if kind == "cancel":
            self._cancel()
        elif kind == "chat":
            await self._start_turn(frame)
        else:
            await self.send_error(_bad_frame(
                f"unknown frame type {kind!r}; expected 'chat' or 'cancel'", param="type"))

    async def _start_turn(self, body: dict[str, Any]) -> None:
        if self.turn is not None:
            await self.send_error(ApiError(
                409, "a reply is still streaming on this socket; send a cancel frame or wait "
                "for its done frame", type="invalid_request_error", code="turn_in_flight"))
            return
        arrived = time.monotonic()
        turn = Turn(id=f"chatcmpl-{uuid.uuid4().hex}")
        truncation = body.pop("truncation", None)
        if truncation not in (None, "auto", "disabled"):
            await self.send_error(bad_request(
                f"Invalid request: truncation: must be 'auto' or 'disabled', got "
                f"{truncation!r}", "truncation"), turn.id)
            return
        self.turn = turn
        self._task = asyncio.create_task(
            self._run_turn(turn, body, arrived, truncate=truncation == "auto"))

    def _cancel(self) -> None:
        """Abort the turn in flight; the engine ends it with ``finish_reason: "abort"``. A
        cancel with no turn in flight (its done frame may be on the way) is ignored."""
        turn = self.turn
        if turn is None or turn.cancelled:
            return
        turn.cancelled = True
        self.state.engine.abort(turn.id)

    async def _drop_turn(self) -> None:
        """The socket closed: cancel the turn's task, which aborts its request."""
        task = self._task
        if task is None or task.done():
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _run_turn(self, turn: Turn, body: dict[str, Any], arrived: float, *,
                        truncate: bool) -> None:
        """Prepare the turn off the loop, admit it (else a 429 error frame), stream it."""
        ticket = None
        try:
            try:
                prep = await prepare_off_loop(
                    self.state, arrived, functools.partial(_prepare_turn, body, self.state,
                                                           truncate), self._client_of)
                if not turn.cancelled:  # a cancel while it was prepared: nothing to admit
                    ticket = self.state.admission.admit(prep.arrival.client,  # else 429
                                                        prep.params.n)
            except ApiError as exc:
                terminal = _error_frame(exc, turn.id)
            except Exception as exc:  # noqa: BLE001 - one bad request must not end the socket
                logger.exception("preparing a websocket chat request failed")
                terminal = _error_frame(_internal(exc), turn.id)
            else:
                terminal = await self._play(turn, prep)
        finally:
            # The request is over in the engine, and its sequences given back, before the
            # terminal frame leaves, so a client may send its next request as soon as it
            # reads that frame.
            if ticket is not None:
                ticket.release()
            if self.turn is turn:
                self.turn = None
        if terminal is not None:
            with contextlib.suppress(_SocketGone):
                await self._send(terminal)

    def _client_of(self, body: dict[str, Any]) -> str:
        return client_key(self.state.settings.fair_share_by, self.ws.scope, self.ws.headers,
                          body, api_key=self._key)

    async def _play(self, turn: Turn, prep: PreparedRequest) -> dict[str, Any] | None:
        """Stream the turn's deltas; returns its terminal frame (``None``: the client left)."""
        tracker = self.state.metrics.track(len(prep.prompt_token_ids))
        try:
            if not turn.cancelled:  # a cancel before the task started: nothing was queued
                await self._stream(turn, prep, tracker)
        except ApiError as error:
            tracker.finish(prep.params.n, "error")
            return _error_frame(error, turn.id)
        except _SocketGone:
            return None
        except Exception as exc:  # noqa: BLE001 - the socket outlives a failed turn
            logger.exception("websocket chat turn %s failed", turn.id)
            tracker.finish(prep.params.n, "error")
            return _error_frame(_internal(exc), turn.id)
        finally:
            tracker.finish(prep.params.n, "abort")  # no-op if already finished
        return self._done_frame(turn, prep)

    async def _stream(self, turn: Turn, prep: PreparedRequest, tracker: RequestTracker
                      ) -> None:
        """Forward the engine's deltas as delta frames until the request finishes."""
        turn.replies = [ReplyDeltas(prep.tool_use, prep.reasoning)
                        for _ in range(prep.params.n)]
        stream = generate(self.state, turn.id, prep.prompt_token_ids, prep.params, prep.prompt,
                          prep.arrival)
        expired = False
        async with contextlib.aclosing(stream):
            async for out in stream:
                expired = expired or timed_out(out)
                tracker.observe(out)
                turn.num_cached_tokens = max(turn.num_cached_tokens, out.num_cached_tokens)
                for choice in out.outputs:
                    if await self._forward(turn, prep, choice):
                        tracker.sent()
        if expired:  # the error frame names the timeout, where a done frame would come
            raise timeout_error(prep.timeout)

    async def _forward(self, turn: Turn, prep: PreparedRequest, choice: CompletionOutput
                       ) -> bool:
        """Send one choice's delta as a delta frame; ``False`` if it had nothing to send."""
        turn.num_tokens += len(choice.token_ids)
        delta, reason = turn.replies[choice.index].feed(choice.text, choice.finish_reason)
        if reason is not None:
            turn.finish_reasons[choice.index] = reason
        if not delta and not choice.token_ids:
            return False
        frame: dict[str, Any] = {"type": "delta", "id": turn.id, "index": choice.index,
                                 "text": delta.get("content", ""),
                                 "num_tokens": len(choice.token_ids)}
        if "reasoning_content" in delta:
            frame["reasoning"] = delta["reasoning_content"]
        if "tool_calls" in delta:
            frame["tool_calls"] = delta["tool_calls"]
        if prep.logprobs:
            frame["logprobs"] = chat_logprobs(self.state, choice.token_ids, choice.logprobs,
                                              prep.top_logprobs)
        await self._send(frame)
        return True

    def _done_frame(self, turn: Turn, prep: PreparedRequest) -> dict[str, Any]:
        reasons = [turn.finish_reasons.get(i, "abort") for i in range(prep.params.n)]
        frame = {"type": "done", "id": turn.id, "model": prep.model, "finish_reason": reasons[0],
                 "choices": [{"index": i, "finish_reason": r} for i, r in enumerate(reasons)],
                 "usage": usage(len(prep.prompt_token_ids), turn.num_tokens,
                                turn.num_cached_tokens)}
        if prep.dropped_messages is not None:
            frame["dropped_messages"] = prep.dropped_messages
        return frame

    async def send_error(self, error: ApiError, turn_id: str | None = None) -> None:
        with contextlib.suppress(_SocketGone):
            await self._send(_error_frame(error, turn_id))

    async def _send(self, frame: dict) -> None:
        """Send one frame; raises ``_SocketGone`` when the client has left."""
        async with self._send_lock:
            if self.ws.application_state != WebSocketState.CONNECTED:
                raise _SocketGone
            try:
                await self.ws.send_text(orjson.dumps(frame).decode())
            except (WebSocketDisconnect, RuntimeError, OSError) as exc:
                raise _SocketGone from exc


class _SocketGone(Exception):
    """The client closed the socket while a frame was being sent."""


def _prepare_turn(body: dict[str, Any], state: ServerState, truncate: bool
                  ) -> tuple[dict[str, Any], PreparedRequest]:
    """On the prepare pool: the turn's frame validated, templated and tokenized."""
    # a turn always streams, so stream_options apply whatever "stream" says
    return body, prepare_chat_request(body | {"stream": True}, state, require_model=False,
                                      truncate=truncate)


def _error_frame(error: ApiError, turn_id: str | None) -> dict[str, Any]:
    """``{"type": "error", "id", "error": {...}}``; a refusal to retry later (429) adds
    ``"retry_after"``: seconds, as the HTTP API's ``Retry-After`` header."""
    frame: dict[str, Any] = {"type": "error"}
    if turn_id is not None:
        frame["id"] = turn_id
    frame.update(error.to_dict())
    retry_after = (error.headers or {}).get("Retry-After")
    if retry_after is not None:
        frame["retry_after"] = int(retry_after)
    return frame


def _internal(exc: Exception) -> ApiError:
    return ApiError(500, f"Internal server error: {exc!r}")


def _bad_frame(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param, code="invalid_frame")
