"""The websocket chat at /v1/chat/ws of the real server process on a tiny model, talked to
with the ``websockets`` client (the handler against a scripted engine: ``test_websocket.py``)."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import websockets

from tests.live_server import (
    aborted,
    build_chat_model,
    finished,
    metrics,
    running_server,
    wait_metrics,
    wait_until_idle,
)
from tests.unit.app.test_websocket import HELLO, WS_PATH

# A stuck stream must fail its test, not stall the suite.
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]

LONG = 1500  # more tokens than a reply can produce before a cancel lands
LONG_REQUEST = {"messages": HELLO, "max_tokens": LONG, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("ws-server")
    # admission: 4 running + 4 waiting in all, one client's share 4 + 2 (the turns here run one
    # sequence at a time but for the refusal test's)
    with running_server(build_chat_model(tmp / "model"), "--kv-cache-memory", "64MiB",
                        "--max-num-seqs", "4", "--max-waiting-seqs", "4") as srv:
        yield srv.url


def ws_url(base: str) -> str:
    return base.replace("http://", "ws://") + WS_PATH


async def recv(ws: Any) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), 120))


async def turn_frames(ws: Any) -> tuple[list[dict], dict]:
    deltas = []
    while True:
        frame = await recv(ws)
        if frame["type"] != "delta":
            return deltas, frame
        deltas.append(frame)


def settled(base: str) -> dict:
    """The engine idle and every turn's admission given back."""
    return wait_metrics(base, lambda v: v["tidal:num_requests_running"] == 0
                        and v["tidal:num_requests_waiting"] == 0
                        and v["tidal:kv_cache_used_blocks"] == 0
                        and v["tidal:admitted_sequences"] == 0
                        and v["tidal:admitted_clients"] == 0,
                        "the engine idle and every admission given back")


def http_chat(base: str, body: dict) -> dict:
    request = urllib.request.Request(base + "/v1/chat/completions",
                                     data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=120) as resp:
        return json.loads(resp.read())


@pytest.mark.integration
async def test_multi_turn_on_one_socket_matches_http_greedy(server: str) -> None:
    before = wait_until_idle(server)
    messages = list(HELLO)
    params = {"max_tokens": 12, "temperature": 0}
    generated = 0
    async with websockets.connect(ws_url(server)) as ws:
        ids = set()
        for follow_up in ("Tell me more.", "And then?"):
            await ws.send(json.dumps({"messages": messages, **params}))
            deltas, done = await turn_frames(ws)
            assert done["type"] == "done", done
            assert {d["id"] for d in deltas} == {done["id"]} and done["id"] not in ids
            ids.add(done["id"])
            text = "".join(d["text"] for d in deltas)
            assert text and done["usage"]["completion_tokens"] > 0
            assert sum(d["num_tokens"] for d in deltas) == done["usage"]["completion_tokens"]
            reference = http_chat(server, {"model": done["model"], "messages": messages,
                                           **params})
            assert text == reference["choices"][0]["message"]["content"]
            assert done["finish_reason"] == reference["choices"][0]["finish_reason"]
            assert done["usage"]["prompt_tokens"] == reference["usage"]["prompt_tokens"]
            assert done["usage"]["completion_tokens"] == \
                reference["usage"]["completion_tokens"]
            generated += done["usage"]["completion_tokens"]
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": follow_up}]
    # Websocket turns are counted in /metrics like HTTP requests (each turn ran twice).
    after = wait_until_idle(server)
    assert finished(after) == finished(before) + 4
    assert after["tidal:generation_tokens_total"] == \
        before["tidal:generation_tokens_total"] + 2 * generated


@pytest.mark.integration
async def test_cancel_frame_aborts_the_turn_and_frees_its_blocks(server: str) -> None:
    before = aborted(wait_until_idle(server))
    async with websockets.connect(ws_url(server)) as ws:
        await ws.send(json.dumps(LONG_REQUEST))
        first = await recv(ws)
        assert first["type"] == "delta", first
        await ws.send(json.dumps({"messages": HELLO}))  # one turn at a time
        streamed, busy = await turn_frames(ws)  # the reply goes on streaming meanwhile
        assert busy["type"] == "error" and busy["error"]["code"] == "turn_in_flight", busy
        assert "id" not in busy
        await ws.send(json.dumps({"type": "cancel"}))
        deltas, done = await turn_frames(ws)
        assert done["type"] == "done" and done["id"] == first["id"], done
        assert done["finish_reason"] == "abort"
        assert {d["id"] for d in streamed + deltas} <= {first["id"]}
        generated = sum(d["num_tokens"] for d in [first, *streamed, *deltas])
        assert generated == done["usage"]["completion_tokens"] < LONG
        m = wait_until_idle(server)
        assert aborted(m) == before + 1
        # The socket carries on with the next turn.
        await ws.send(json.dumps({"messages": HELLO, "max_tokens": 3, "ignore_eos": True}))
        deltas, done = await turn_frames(ws)
        assert done["finish_reason"] == "length" and done["usage"]["completion_tokens"] == 3
    assert aborted(wait_until_idle(server)) == before + 1


@pytest.mark.integration
async def test_a_turn_past_its_timeout_ends_in_an_error_frame_naming_it(server: str) -> None:
    before = aborted(wait_until_idle(server))
    async with websockets.connect(ws_url(server)) as ws:
        await ws.send(json.dumps(LONG_REQUEST | {"timeout": 0.5}))
        deltas, end = await turn_frames(ws)
        assert deltas, "tokens should stream before the timeout"
        assert end["type"] == "error" and end["error"]["code"] == "request_timeout", end
        assert end["error"]["param"] == "timeout" and end["id"] == deltas[0]["id"]
        await ws.send(json.dumps({"messages": HELLO, "timeout": 0}))
        _, refused = await turn_frames(ws)
        assert refused["type"] == "error" and refused["error"]["param"] == "timeout", refused
    assert aborted(wait_until_idle(server)) == before + 1


@pytest.mark.integration
async def test_closing_the_socket_mid_turn_aborts_it(server: str) -> None:
    before = aborted(wait_until_idle(server))
    for _ in range(3):
        async with websockets.connect(ws_url(server)) as ws:
            await ws.send(json.dumps(LONG_REQUEST))
            assert (await recv(ws))["type"] == "delta"
            held = await asyncio.to_thread(metrics, server)
            assert held["tidal:admitted_sequences"] == 1, held
    # Each request was aborted, not run to its end: the handler saw no finish reason; and
    # each gave its admission back.
    assert aborted(settled(server)) == before + 3


@pytest.mark.integration
async def test_a_refused_turn_gets_a_429_frame_and_the_socket_retries(server: str) -> None:
    """One client holds 4 sequences; its turn of 3 more would pass its share (6): a 429
    error frame with ``retry_after``, and the same turn goes through once the first ends."""
    settled(server)
    async with websockets.connect(ws_url(server)) as first, \
            websockets.connect(ws_url(server)) as second:
        await first.send(json.dumps(LONG_REQUEST | {"n": 4}))
        assert (await recv(first))["type"] == "delta"
        turn = {"messages": HELLO, "max_tokens": 2, "n": 3, "ignore_eos": True}
        await second.send(json.dumps(turn))
        deltas, refused = await turn_frames(second)
        assert deltas == [] and refused["type"] == "error", refused
        assert refused["error"]["code"] == "rate_limit_exceeded" and refused["retry_after"] == 1
        assert refused["error"]["type"] == "rate_limit_error" and refused["id"]
        await first.send(json.dumps({"type": "cancel"}))
        _, done = await turn_frames(first)
        assert done["type"] == "done" and done["finish_reason"] == "abort", done
        await second.send(json.dumps(turn))
        deltas, done = await turn_frames(second)
        assert done["type"] == "done" and done["usage"]["completion_tokens"] == 6, done
    values = settled(server)
    assert values['tidal:requests_rejected_total{reason="client"}'] >= 1


@pytest.mark.integration
async def test_bad_requests_get_error_frames_and_the_socket_keeps_working(server: str
                                                                           ) -> None:
    bad = [
        ("{oops", None, 400),
        (json.dumps({"messages": []}), "messages", 400),
        (json.dumps({"messages": HELLO, "top_p": 7}), "top_p", 400),
        (json.dumps({"messages": [{"role": "user", "content": "hi " * 3000}]}), "messages",
         400),
        (json.dumps({"messages": HELLO, "model": "no-such-model"}), "model", 404),
    ]
    async with websockets.connect(ws_url(server)) as ws:
        for frame, param, status in bad:
            await ws.send(frame)
            error = await recv(ws)
            assert error["type"] == "error", (frame, error)
            assert error["error"]["param"] == param and error["error"]["message"]
            if status == 404:
                assert error["error"]["code"] == "model_not_found"
            await ws.send(json.dumps({"messages": HELLO, "max_tokens": 2, "ignore_eos": True}))
            deltas, done = await turn_frames(ws)
            assert done["type"] == "done" and done["usage"]["completion_tokens"] == 2
    with urllib.request.urlopen(server + "/health", timeout=10) as resp:
        assert resp.status == 200
    wait_until_idle(server)
