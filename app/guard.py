"""The doors in front of every route: which hosts, origins and keys get in, and how long and how
large a request body may be. docs/robustness.md ("Doors and transport limits") says why.

``RequestGuard`` is an ASGI middleware, inside CORS (so that its refusals carry CORS headers for
origins CORS allows) and outside the routes:

- ``Host``: a name not in ``--allowed-hosts`` gets 400 (DNS rebinding: a page on
  ``evil.example``, re-pointed at 127.0.0.1, reaches a loopback server with that Host). The
  CLI's default on a loopback bind is the loopback names; on a wildcard bind any name.
- ``Origin``: a browser's request from a page of another origin gets 403 unless CORS
  (``--allowed-origins``) allows that origin; so does one marked ``Sec-Fetch-Site:
  cross-site`` (a form or image a foreign page sends), but for opening the chat page itself.
  Requests without either header (curl, SDKs, routers) are not affected. The same check covers
  the websocket, which browsers open from any page without CORS.
- ``--api-key``: every HTTP route but ``/health`` and the chat page's HTML at ``/`` needs
  ``Authorization: Bearer <key>`` (``/metrics`` too, unless ``--metrics-without-key``); the
  websocket checks its key itself, to answer with a frame the page understands.
- The body: at most ``--max-request-bytes`` (413 once the bytes pass it, not after reading
  the rest), all of it within ``--request-body-timeout`` seconds of the headers (408); both
  answers close the connection, whose remaining body is never read.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tidal.app.errors import ApiError
from tidal.app.server_state import ServerSettings

OPEN_PATHS = ("/health",)  # answered without the API key
PAGE_PATH = "/"  # the chat page's HTML: no secret in it, and a browser cannot send the key
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
CLOSE = {"Connection": "close"}


def default_allowed_hosts(bind_host: str) -> list[str] | None:
    """The Host names a server bound to ``bind_host`` answers by default: the loopback names
    (and the address) on a loopback bind; any (``None``) otherwise."""
    name = bind_host.strip("[]").lower()
    if name == "localhost" or _is_loopback(name):
        return list(dict.fromkeys([*LOOPBACK_NAMES, name]))
    return None


def _is_loopback(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_name(host_header: str) -> str:
    """``"localhost:8000"`` -> ``"localhost"``; ``"[::1]:8000"`` -> ``"::1"``."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host[1:]
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def host_allowed(host_header: str | None, allowed: list[str] | None) -> bool:
    """Whether ``allowed`` (exact names, ``.example.com`` for it and its subdomains, ``*``)
    takes the request's Host; a request with none (HTTP/1.0) is taken: browsers send one."""
    if allowed is None or host_header is None or "*" in allowed:
        return True
    name = host_name(host_header)
    for entry in allowed:
        entry = entry.lower().strip("[]")
        if name == entry or (entry.startswith(".") and (name.endswith(entry)
                                                        or name == entry[1:])):
            return True
    return False


def origin_allowed(origin: str, host_header: str | None, allowed_origins: list[str]) -> bool:
    """Whether a request from a page of ``origin`` may be served: the server's own origin
    (same host and port as the request's Host), or one CORS allows."""
    if "*" in allowed_origins or origin in allowed_origins:
        return True
    if origin == "null" or host_header is None:
        return False
    scheme, sep, netloc = origin.partition("://")
    if not sep:
        return False
    return _netloc(scheme, netloc) == _netloc(scheme, host_header)


def _netloc(scheme: str, netloc: str) -> str:
    """``host:port`` with the scheme's default port made explicit, lower case."""
    netloc = netloc.strip().lower().rstrip("/")
    default = "443" if scheme.lower() in ("https", "wss") else "80"
    if netloc.startswith("["):
        end = netloc.find("]")
        host, rest = netloc[:end + 1], netloc[end + 1:]
        return host + (rest if rest.startswith(":") else f":{default}")
    return netloc if ":" in netloc else f"{netloc}:{default}"


def key_matches(authorization: str, key: str) -> bool:
    """Whether an ``Authorization`` header is ``Bearer <key>``."""
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              key.encode())


class RequestGuard:
    """The middleware: see the module's docstring."""

    def __init__(self, app: ASGIApp, settings: ServerSettings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            await _refuse(scope, receive, send, refusal)
            return
        if scope["type"] == "http":
            receive = BodyLimits(receive, self.settings.max_request_bytes,
                                 self.settings.request_body_timeout)
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope, headers: Headers) -> ApiError | None:
        settings = self.settings
        host = headers.get("host")
        if not host_allowed(host, settings.allowed_hosts):
            return ApiError(400, f"The Host header {host!r} is not one this server answers to "
                            "(--allowed-hosts)", code="host_not_allowed", headers=CLOSE)
        origin = headers.get("origin")
        if origin is not None:
            if not origin_allowed(origin, host, settings.allowed_origins):
                return ApiError(403, f"Requests from pages of {origin} are refused: add it to "
                                "--allowed-origins to allow them", code="origin_not_allowed")
        elif headers.get("sec-fetch-site") == "cross-site" and not _opens_page(scope, headers):
            return ApiError(403, "Cross-site requests are refused: add the page's origin to "
                            "--allowed-origins to allow them", code="origin_not_allowed")
        if scope["type"] == "http" and settings.api_key and not self._open(scope) \
                and not key_matches(headers.get("authorization", ""), settings.api_key):
            return ApiError(401, "Invalid or missing API key: send `Authorization: Bearer "
                            "<key>`", code="invalid_api_key")
        if scope["type"] == "http":
            declared = headers.get("content-length", "")
            if declared.isdigit() and int(declared) > settings.max_request_bytes:
                return too_large(settings.max_request_bytes)
        return None

    def _open(self, scope: Scope) -> bool:
        path = scope["path"]
        return (path in OPEN_PATHS or (path == PAGE_PATH and scope["method"] in ("GET", "HEAD"))
                or (path == "/metrics" and self.settings.metrics_without_key))


def _opens_page(scope: Scope, headers: Headers) -> bool:
    """A link from another site to the chat page: a top-level navigation, GET ``/``."""
    return (scope["type"] == "http" and scope["path"] == PAGE_PATH
            and scope["method"] in ("GET", "HEAD")
            and headers.get("sec-fetch-mode", "navigate") == "navigate")


async def _refuse(scope: Scope, receive: Receive, send: Send, error: ApiError) -> None:
    if scope["type"] == "websocket":
        # closed before it is accepted: the server answers the handshake with 403
        await receive()  # websocket.connect
        await send({"type": "websocket.close", "code": 1008, "reason": error.message[:120]})
        return
    response = JSONResponse(error.to_dict(), status_code=error.status,
                            headers={**CLOSE, **(error.headers or {})})
    await response(scope, receive, send)


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"The request body is larger than the limit of {limit} bytes",
                    code="request_too_large", headers=CLOSE)


class BodyLimits:
    """An ASGI ``receive`` that raises ``ApiError`` 413 once the body passes ``limit`` bytes
    and 408 once it has taken ``timeout`` seconds (from the first call); a route reading the
    body gets the error, which the app's handler answers with ``Connection: close``. Once the
    body has arrived it is the plain ``receive`` (a stream listening for the disconnect)."""

    def __init__(self, receive: Receive, limit: int, timeout: float) -> None:
        self._receive = receive
        self.limit = limit
        self.timeout = timeout
        self.size = 0
        self.done = False
        self._deadline: float | None = None

    async def __call__(self) -> Message:
        if self.done:
            return await self._receive()
        loop = asyncio.get_running_loop()
        if self._deadline is None:
            self._deadline = loop.time() + self.timeout
        try:
            async with asyncio.timeout_at(self._deadline):
                message = await self._receive()
        except TimeoutError:
            self.done = True
            raise ApiError(408, f"The request body did not arrive within {self.timeout:g} s",
                           type="timeout_error", code="request_body_timeout",
                           headers=CLOSE) from None
        if message["type"] != "http.request":
            self.done = True  # http.disconnect
            return message
        self.size += len(message.get("body", b""))
        if self.size > self.limit:
            self.done = True
            raise too_large(self.limit)
        if not message.get("more_body", False):
            self.done = True
        return message
