"""The server's front door while the model loads.

The socket opens before the model loads, so a health check or a router in front of several
replicas gets ``503`` from ``/health`` (and from every other route) instead of a refused
connection; once the engine is up, ``open()`` starts the real app's lifespan (which starts the
engine thread) and every request goes to the app.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from tidal.app.errors import ApiError

if TYPE_CHECKING:
    from starlette.applications import Starlette

LOADING = ApiError(503, "The model is loading; try again shortly", code="model_loading")
TRY_AGAIN_LATER = 1013  # the websocket close code for a server not ready yet


class LoadingGate:
    """An ASGI app that answers 503 until ``open(app)``, then hands every request to ``app``."""

    def __init__(self) -> None:
        self.app: Starlette | None = None
        self._lifespan = contextlib.AsyncExitStack()

    async def open(self, app: Starlette) -> None:
        await self._lifespan.enter_async_context(app.router.lifespan_context(app))
        self.app = app

    async def close(self) -> None:
        """End the app's lifespan (stopping the engine); later calls do nothing."""
        await self._lifespan.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._serve_lifespan(receive, send)
        elif self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            response = JSONResponse(LOADING.to_dict(), status_code=LOADING.status,
                                    headers={"Retry-After": "1"})
            await response(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": TRY_AGAIN_LATER})

    async def _serve_lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.close()
                await send({"type": "lifespan.shutdown.complete"})
                return
