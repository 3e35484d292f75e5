"""The real server process under bad input, clients that leave, load, an API key and a
shutdown: every error in the OpenAI shape naming its field, every abandoned request aborted and
its KV blocks freed, and the server serving on."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.live_server import (
    CHAT,
    GREEDY,
    Server,
    aborted,
    api_server,
    build_chat_model,
    check_chat_stream,
    is_idle,
    running_server,
    sse_events,
)

pytestmark = [pytest.mark.gpu, pytest.mark.integration]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from api_server(tmp_path_factory)


# -- bad input --------------------------------------------------------------------------------
def _bad_cases(model: str) -> list[tuple[str, bytes, int, str | None]]:
    chat = "/v1/chat/completions"
    comp = "/v1/completions"

    def body(**fields: Any) -> bytes:
        return json.dumps({"model": model, "messages": CHAT, **fields}).encode()

    long_chat = json.dumps({"model": model, "messages": [
        {"role": "user", "content": "fox " * 2100}]}).encode()
    return [
        (chat, b'{"model": "x", "messages": [', 400, None),
        (chat, b"[1, 2]", 400, None),
        (chat, b"", 400, None),
        (chat, json.dumps({"messages": CHAT}).encode(), 400, "model"),
        (chat, json.dumps({"model": model}).encode(), 400, "messages"),
        (chat, body(messages="hello"), 400, "messages"),
        (chat, body(messages=[{"role": "robot", "content": "hi"}]), 400, "messages[0].role"),
        (chat, body(messages=[{"role": "user", "content": 7}]), 400, "messages[0].content"),
        (chat, body(temperature="hot"), 400, "temperature"),
        (chat, body(temperature=-0.5), 400, "temperature"),
        (chat, body(top_p=2), 400, "top_p"),
        (chat, body(max_tokens="10"), 400, "max_tokens"),
        (chat, body(max_tokens=-1), 400, "max_tokens"),
        (chat, body(n=0), 400, "n"),
        (chat, body(stop=[1, 2]), 400, "stop"),
        (chat, body(logprobs=True, top_logprobs=99), 400, "top_logprobs"),
        (chat, body(stream_options={"include_usage": True}), 400, "stream_options"),
        (chat, long_chat, 400, "messages"),
        (chat, body(max_tokens=100_000), 400, "max_tokens"),
        (chat, body(model="no-such-model"), 404, "model"),
        (comp, json.dumps({"model": model}).encode(), 400, "prompt"),
        (comp, json.dumps({"model": model, "prompt": [1, "a"]}).encode(), 400, "prompt"),
        (comp, json.dumps({"model": model, "prompt": [10**7]}).encode(), 400, "prompt"),
        (comp, json.dumps({"model": model, "prompt": "hi", "logprobs": 50}).encode(), 400,
         "logprobs"),
        (comp, json.dumps({"model": model, "prompt": "hi", "max_tokens": 4000}).encode(), 400,
         "max_tokens"),
        (comp, json.dumps({"model": model, "prompt": "x" * 70_000}).encode(), 413, None),
    ]


def test_bad_input_gets_openai_errors_and_the_server_keeps_serving(server: Server) -> None:
    for path, raw, status, param in _bad_cases(server.model):
        resp = httpx.post(server.url + path, content=raw, timeout=60)
        assert resp.status_code == status, (raw[:200], resp.text)
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["param"] == param and error["message"], (raw[:200], error)
    assert httpx.get(server.url + "/health").status_code == 200
    assert server.chat(max_tokens=3)["choices"][0]["finish_reason"] in ("stop", "length")


def test_oversized_body_without_content_length_is_413(server: Server) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "x", "prompt": "'
        for _ in range(40):
            yield b"y" * 4096
        yield b'"}'

    resp = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=60)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"


def test_unknown_routes_and_methods_get_json_errors(server: Server) -> None:
    missing = httpx.get(server.url + "/v1/nothing")
    assert missing.status_code == 404 and "error" in missing.json()
    wrong = httpx.get(server.url + "/v1/chat/completions")
    assert wrong.status_code == 405 and "error" in wrong.json()


def test_openai_client_raises_on_bad_input(server: Server) -> None:
    client = server.openai()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.model, messages=CHAT, n=0)
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-nothing", messages=CHAT)


# -- disconnects and load ---------------------------------------------------------------------
def _open_stream(server: Server, body: dict) -> socket.socket:
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                 b"Content-Type: application/json\r\nContent-Length: "
                 + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    return sock


def _read_until(sock: socket.socket, count: int) -> bytes:
    data = b""
    while data.count(b"data: ") < count:
        chunk = sock.recv(65536)
        assert chunk, f"the stream ended early: {data!r}"
        data += chunk
    return data


def test_streams_closed_midway_leave_nothing_running(server: Server) -> None:
    aborts = aborted(server.metrics())
    body = {"model": server.model, "messages": CHAT, "max_tokens": 1800, "stream": True,
            **GREEDY}
    socks = [_open_stream(server, body) for _ in range(8)]
    for sock in socks:
        assert b" 200 " in _read_until(sock, 3).split(b"\r\n", 1)[0]
    server.wait_metrics(lambda v: v["tidal:num_requests_running"] == 8, "8 running")
    for sock in socks:
        sock.close()
    values = server.wait_metrics(is_idle, "all aborted and freed")
    assert values["tidal:kv_cache_usage_perc"] == 0
    assert aborted(values) - aborts == 8
    assert httpx.get(server.url + "/health").status_code == 200


def test_non_streamed_request_is_aborted_when_the_client_leaves(server: Server) -> None:
    aborts = aborted(server.metrics())
    body = {"model": server.model, "messages": CHAT, "max_tokens": 1800, **GREEDY}
    sock = _open_stream(server, body)
    server.wait_metrics(lambda v: v["tidal:num_requests_running"] == 1, "1 running")
    sock.close()
    values = server.wait_metrics(is_idle, "aborted and freed")
    assert aborted(values) - aborts == 1


def test_32_concurrent_streams_all_finish(server: Server) -> None:
    async def one(client: httpx.AsyncClient, i: int) -> bytes:
        body = {"model": server.model, "max_tokens": 16, "stream": True,
                "messages": [{"role": "user", "content": f"Story number {i}"}], **GREEDY}
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            return b"".join([chunk async for chunk in resp.aiter_bytes()])

    async def all_of_them() -> list[bytes]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(all_of_them())
    for raw in results:
        texts = check_chat_stream(sse_events(raw))
        assert texts[0]
    server.wait_metrics(is_idle, "all finished")


# -- API key and shutdown, on a server of their own -------------------------------------------
@pytest.mark.slow
def test_api_key_and_clean_shutdown(tmp_path: Path) -> None:
    model = build_chat_model(tmp_path / "tiny")
    with running_server(model, "--kv-cache-memory", "8MiB", "--api-key", "sekrit",
                        "--served-model-name", "tiny-secure") as srv:
        body = {"model": "tiny-secure", "messages": CHAT, "max_tokens": 3}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            resp = httpx.post(srv.url + "/v1/chat/completions", json=body, headers=headers,
                              timeout=60)
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        assert httpx.get(srv.url + "/health").status_code == 200
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekrit", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-secure"]
        out = client.chat.completions.create(model="tiny-secure", messages=CHAT, max_tokens=3)
        assert out.choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.NotFoundError):  # the served name, not the path, is the id
            client.chat.completions.create(model=str(model), messages=CHAT, max_tokens=3)

        stream = client.chat.completions.create(model="tiny-secure", messages=CHAT,
                                                max_tokens=1800, stream=True,
                                                extra_body={"ignore_eos": True})
        next(iter(stream))
        srv.proc.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError, match="shutting down|shut down|not running"):
            for _ in stream:
                pass
        assert srv.proc.wait(60) == 0
