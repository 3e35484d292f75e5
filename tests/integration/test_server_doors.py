"""The real server's doors and transport limits (app/guard.py): each attack, and beside it a
normal request that must be answered in time while the attack is in flight.

One server: ``--api-key``, a 64 KiB body limit and a 2 s body timeout, on 127.0.0.1 (so the
default Host allow-list applies)."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import websockets

from tests.live_server import CHAT, Server, build_chat_model, running_server
from tidal.app.websocket import key_protocol

pytestmark = [pytest.mark.integration]

KEY = "sekrit/+="
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_TIMEOUT_S = 2
ANSWER_WITHIN_S = 20.0  # a normal request beside an attack: generous for 2 busy cores


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = build_chat_model(tmp_path_factory.mktemp("doors") / "tiny")
    with running_server(model, "--kv-cache-memory", "8MiB", "--max-request-bytes", "64KiB",
                        "--api-key", KEY, "--request-body-timeout", str(BODY_TIMEOUT_S),
                        "--served-model-name", "tiny") as srv:
        yield Server(srv.url, srv.port, "tiny")


def _normal_request(server: Server) -> None:
    """A chat answered within ANSWER_WITHIN_S."""
    started = time.monotonic()
    resp = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"model": server.model, "messages": CHAT, "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    assert time.monotonic() - started < ANSWER_WITHIN_S


def _connect(server: Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=30)


def _read_all(sock: socket.socket, timeout: float) -> bytes:
    """What the server sends until it closes the connection (within ``timeout``)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


# -- transport --------------------------------------------------------------------------------
def test_chunked_body_past_the_cap_is_cut_off_at_the_cap(server: Server) -> None:
    """A chunked body that never ends: 413 and the connection closed once the cap is passed,
    not after reading it all (20.9 GB in 30 s before)."""
    sock = _connect(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
                 + KEY.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"10000\r\n" + b"x" * 0x10000 + b"\r\n"
    sent, refused = 0, threading.Event()

    def flood() -> None:
        nonlocal sent
        try:
            while sent < (2 << 30) and not refused.is_set():
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:  # the server closed the connection
            pass

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        _normal_request(server)
        reply = _read_all(sock, 30)
    finally:
        refused.set()
        flooder.join(30)
        sock.close()
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"request_too_large" in reply and b"connection: close" in reply.lower()
    assert sent < 64 << 20, sent  # the cap and the sockets' buffers, not gigabytes


def test_body_that_does_not_arrive_gets_408_and_is_closed(server: Server) -> None:
    sock = _connect(server)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: "
                 b"Bearer " + KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n{\"model\"")
    started = time.monotonic()
    _normal_request(server)
    reply = _read_all(sock, BODY_TIMEOUT_S + 20)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"request_body_timeout" in reply
    assert time.monotonic() - started < BODY_TIMEOUT_S + 20


def test_slow_drip_body_is_cut_off_by_the_deadline(server: Server) -> None:
    """A byte a second keeps no connection past the body's deadline."""
    sock = _connect(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
                 + KEY.encode() + b"\r\nContent-Length: 60000\r\n\r\n")
    started, reply = time.monotonic(), b""
    sock.settimeout(1.0)
    while time.monotonic() - started < BODY_TIMEOUT_S + 20:
        try:
            sock.sendall(b"x")
            reply += sock.recv(65536)
            if reply:
                break
        except TimeoutError:
            continue
        except OSError:
            break
    sock.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]


def test_idle_connections_are_closed(server: Server) -> None:
    """No request at all, half a request line, and an idle keep-alive after a request."""
    idle, partial, kept = _connect(server), _connect(server), _connect(server)
    partial.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    started = time.monotonic()
    _normal_request(server)
    for sock, want in ((idle, b""), (partial, b""), (kept, b"HTTP/1.1 200")):
        got = _read_all(sock, 30)
        assert got.startswith(want), got[:100]
        sock.close()
    assert time.monotonic() - started < 30  # keep-alive timeout 5 s, and margin


# -- doors ------------------------------------------------------------------------------------
def test_every_route_but_health_needs_the_key(server: Server) -> None:
    for path in ("/metrics", "/load", "/get_load", "/get_server_info", "/get_model_info",
                 "/v1/models"):
        resp = httpx.get(server.url + path, timeout=30)
        assert resp.status_code == 401, (path, resp.text)
        assert resp.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(server.url + path, headers=AUTH, timeout=30).status_code == 200, path
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    assert httpx.get(server.url + "/", timeout=30).status_code == 200  # the page's HTML


def test_flush_cache_is_post_only(server: Server) -> None:
    assert httpx.get(server.url + "/flush_cache", headers=AUTH, timeout=30).status_code == 405
    assert httpx.post(server.url + "/flush_cache", timeout=30).status_code == 401
    resp = httpx.post(server.url + "/flush_cache", headers=AUTH, timeout=30)
    assert resp.status_code == 200 and resp.json()["status"] == "ok"


def test_foreign_origins_and_cross_site_requests_are_refused(server: Server) -> None:
    body = json.dumps({"model": server.model, "messages": CHAT, "max_tokens": 1})
    url = server.url + "/v1/chat/completions"
    for headers in ({"Origin": "http://evil.example"}, {"Origin": "null"},
                    {"Sec-Fetch-Site": "cross-site"},
                    {"Origin": "http://evil.example", "Content-Type": "text/plain"}):
        resp = httpx.post(url, content=body, headers={**AUTH, **headers}, timeout=30)
        assert resp.status_code == 403, (headers, resp.text)
        assert resp.json()["error"]["code"] == "origin_not_allowed"
    # the page's own origin, and no Origin at all (curl -d: a form content type), still work
    for headers in ({"Origin": f"http://127.0.0.1:{server.port}"},
                    {"Content-Type": "application/x-www-form-urlencoded"}, {}):
        resp = httpx.post(url, content=body, headers={**AUTH, **headers}, timeout=60)
        assert resp.status_code == 200, (headers, resp.text)


def test_foreign_host_is_refused(server: Server) -> None:
    """DNS rebinding: evil.example resolving to 127.0.0.1 carries its own name as Host."""
    for host in ("evil.example", f"evil.example:{server.port}", "127.0.0.1.evil.example"):
        resp = httpx.get(server.url + "/health", headers={"Host": host}, timeout=30)
        assert resp.status_code == 400, (host, resp.text)
        assert resp.json()["error"]["code"] == "host_not_allowed"
    for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}", "[::1]"):
        assert httpx.get(server.url + "/health", headers={"Host": host},
                         timeout=30).status_code == 200


def test_websocket_key_only_in_headers_and_origin_checked(server: Server) -> None:
    url = server.url.replace("http://", "ws://") + "/v1/chat/ws"

    async def frames() -> None:
        # the key in the URL is no key
        async with websockets.connect(url + "?api_key=" + KEY) as ws:
            error = json.loads(await asyncio.wait_for(ws.recv(), 30))
            assert error["error"]["code"] == "invalid_api_key"
        # a foreign page's socket is refused at the handshake, key or not
        with pytest.raises(websockets.exceptions.InvalidStatus) as info:
            async with websockets.connect(url, origin="http://evil.example",
                                          subprotocols=["tidal", key_protocol(KEY)]):
                pass
        assert info.value.response.status_code == 403
        # the page's way: its own origin, the key as a subprotocol
        async with websockets.connect(url, origin=server.url,
                                      subprotocols=["tidal", key_protocol(KEY)]) as ws:
            assert ws.subprotocol == "tidal"
            await ws.send(json.dumps({"messages": CHAT, "max_tokens": 2}))
            while (frame := json.loads(await asyncio.wait_for(ws.recv(), 60)))["type"] \
                    == "delta":
                pass
            assert frame["type"] == "done", frame

    asyncio.run(frames())


def test_library_errors_reach_the_client_without_paths(server: Server) -> None:
    for response_format in (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "string", "pattern": "a(b"}}}):
        resp = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                          json={"model": server.model, "messages": CHAT, "max_tokens": 2,
                                "response_format": response_format})
        assert resp.status_code == 400, resp.text
        message = resp.json()["error"]["message"]
        assert "/project" not in message and ".cc" not in message, message
        assert not re.search(r"\[\d{1,2}:\d{2}:\d{2}\]", message), message
        assert "does not compile" in message, message
