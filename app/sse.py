"""Server-Sent Events framing and the ASGI responses that race their work against the client
leaving.

Every event is exactly ``data: <json>\\n\\n`` (orjson, no spaces); every stream ends with
``data: [DONE]\\n\\n``. The Responses API's events are OpenAI's typed events instead:
``event: <type>\\ndata: <json>\\n\\n``, without ``[DONE]``.

Both responses below run their work in a task and watch ``receive`` for ``http.disconnect`` at
the same time: when the client goes, the work is cancelled, which leaves
``AsyncEngine.generate`` early and aborts the request. No polling.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import orjson
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def sse_event(payload: Any) -> bytes:
    """One SSE event carrying ``payload`` as compact JSON."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def named_sse_event(name: str, payload: Any) -> bytes:
    """One SSE event of type ``name`` carrying ``payload`` as compact JSON."""
    return b"event: " + name.encode() + b"\n" + sse_event(payload)


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def race_disconnect(receive: Receive, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Run ``work`` until it ends or the client disconnects, whichever comes first.

    Returns ``(True, result)`` when the work finished, ``(False, None)`` when the client left
    (the work is then cancelled and awaited, so its clean-up has run)."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work_task.done():
            work_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work_task
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    if work_task.cancelled():
        return False, None
    return True, work_task.result()


class EventStreamResponse:
    """Streams the byte events an async iterator yields as ``text/event-stream``."""

    def __init__(self, events: AsyncIterator[bytes],
                 on_sent: Callable[[], None] | None = None) -> None:
        self.events = events
        self.on_sent = on_sent  # called after each event is handed to the server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await race_disconnect(receive, self._stream(send))

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        try:
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
                if self.on_sent is not None:
                    self.on_sent()
        finally:
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class DeferredJSONResponse:
    """Computes a JSON response only once the ASGI call starts, racing it against the client
    leaving: a non-streamed generation is aborted when its client disconnects.

    ``compute`` returns ``(status, payload)``."""

    def __init__(self, compute: Callable[[], Awaitable[tuple[int, Any]]]) -> None:
        self.compute = compute

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        finished, result = await race_disconnect(receive, self.compute())
        if not finished or result is None:
            return
        status, payload = result
        await send_json(send, status, payload)


async def send_json(send: Send, status: int, payload: Any) -> None:
    body = orjson.dumps(payload)
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
