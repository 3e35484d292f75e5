"""The Starlette app: routes, error handlers, and a lifespan that runs the engine.

``build_app(engine, settings)`` takes an ``AsyncEngine`` that is constructed (model loaded) but
not started; the lifespan starts its thread on the serving event loop and shuts it down on exit,
failing any request still in flight with an error instead of leaving it hanging.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute

from tidal.app.chat_completions import chat_completions
from tidal.app.completions import completions
from tidal.app.cross_encoder import classify
from tidal.app.embeddings import embeddings
from tidal.app.errors import ApiError
from tidal.app.guard import RequestGuard
from tidal.app.handling import check_api_key, get_state
from tidal.app.metrics import CONTENT_TYPE
from tidal.app.refusals import refusal_cost, refusal_key
from tidal.app.replica import flush_cache, get_load, load, model_info, server_info
from tidal.app.responses import create_response, delete_response, get_response
from tidal.app.scoring import rerank, score
from tidal.app.server_state import ServerSettings, ServerState
from tidal.app.tokenizing import detokenize, tokenize
from tidal.app.tracing import install as install_request_tracing
from tidal.app.websocket import chat_page, chat_websocket

if TYPE_CHECKING:
    from tidal.core.async_engine import AsyncEngine

logger = logging.getLogger(__name__)


def build_app(engine: AsyncEngine, settings: ServerSettings, tracer: Any = None) -> Starlette:
    """``tracer``: an OpenTelemetry tracer for request spans, instead of one exporting to
    ``settings.otlp_traces_endpoint``."""
    state = ServerState.from_engine(engine, settings)
    state.metrics.bind_stats(lambda: engine.stats)
    install_request_tracing(engine, state, tracer)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if not engine.is_alive:
            engine.start()
        try:
            yield
        finally:
            await engine.shutdown()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/responses", create_response, methods=["POST"]),
            Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
            Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
            Route("/v1/embeddings", embeddings, methods=["POST"]),  # --runner pooling
            Route("/v1/score", score, methods=["POST"]),
            Route("/v1/classify", classify, methods=["POST"]),
            Route("/v1/rerank", rerank, methods=["POST"]),
            Route("/v2/rerank", rerank, methods=["POST"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            # what routers in front of several replicas probe (app/replica.py)
            Route("/get_server_info", server_info, methods=["GET"]),
            Route("/server_info", server_info, methods=["GET"]),
            Route("/get_model_info", model_info, methods=["GET"]),
            Route("/model_info", model_info, methods=["GET"]),
            Route("/load", load, methods=["GET"]),
            Route("/get_load", get_load, methods=["GET"]),
            Route("/flush_cache", flush_cache, methods=["POST"]),  # it changes state
            WebSocketRoute("/v1/chat/ws", chat_websocket),
            Route("/", chat_page, methods=["GET"]),
        ],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error,
                            Exception: _server_error},
        middleware=[*_cors(settings.allowed_origins),
                    Middleware(RequestGuard, settings=settings)],
        lifespan=lifespan,
    )
    app.state.tidal = state
    return app


def _cors(origins: list[str]) -> list[Middleware]:
    """Cross-origin access for web pages served elsewhere: any method and header (the API
    key travels in ``Authorization``) from ``origins``; none by default. Outside the guard
    (app/guard.py), whose refusals then carry CORS headers for these origins."""
    if not origins:
        return []
    return [Middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"],
                       allow_headers=["*"])]


async def list_models(request: Request) -> Response:
    state = get_state(request)
    check_api_key(request.headers, state)
    return JSONResponse({"object": "list", "data": [{
        "id": state.served_model_name, "object": "model", "created": _STARTED,
        "owned_by": "tidal", "root": state.settings.model_path or state.served_model_name,
        "max_model_len": state.context_tokens}]})


async def health(request: Request) -> Response:
    engine = get_state(request).engine
    if engine.is_alive:
        return JSONResponse({"status": "ok"})
    return _json_error(ApiError(503, f"The engine is not running: {engine.error or 'stopped'}",
                                code="engine_dead"))


async def metrics(request: Request) -> Response:
    state: ServerState = get_state(request)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    if 400 <= exc.status < 500 and exc.code != "too_many_refusals":
        state = get_state(request)
        state.refusals.record(refusal_key(state.settings.fair_share_by, request.scope,
                                          request.headers), refusal_cost(request.headers))
    return _json_error(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    response = _json_error(ApiError(exc.status_code, exc.detail, type="invalid_request_error"))
    response.headers.update(exc.headers or {})  # a 405's Allow
    return response


async def _server_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error in %s %s", request.method, request.url.path)
    return _json_error(ApiError(500, f"Internal server error: {exc!r}"))


def _json_error(err: ApiError) -> Response:
    return JSONResponse(err.to_dict(), status_code=err.status, headers=err.headers)


_STARTED = int(time.time())
__all__ = ["ServerSettings", "ServerState", "build_app"]
