"""The websocket chat at /v1/chat/ws, its handler driven in-process against a scripted engine,
so the order of events (a cancel frame, the socket closing) is exact (the real server process:
``test_websocket_server.py``)."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient

from tidal.app import websocket as websocket_module
from tidal.app.chat_completions import chat_completions
from tidal.app.chat_template import ChatTemplate
from tidal.app.conversation import truncation_reserve
from tidal.app.errors import ApiError
from tidal.app.metrics import ServerMetrics
from tidal.app.server_state import ServerSettings, ServerState
from tidal.app.websocket import chat_page, chat_websocket, key_protocol
from tidal.core.async_engine import EngineDeadError
from tidal.core.outputs import CompletionOutput, RequestOutput
from tidal.core.sampling_params import SamplingParams

# A stuck stream must fail its test, not stall the suite.
pytestmark = pytest.mark.timeout(180)

WS_PATH = "/v1/chat/ws"
HELLO = [{"role": "user", "content": "Hello there"}]


# -- in-process, against a scripted engine ---------------------------------------------------
class ScriptedEngine:
    """Streams ``t0 t1 ...`` one token per delta. With ``hold=True`` it stops after the first
    token and waits for ``abort`` (which ends the stream with ``finish_reason="abort"``) or
    for its consumer to leave."""

    is_alive = True

    def __init__(self, hold: bool = False) -> None:
        self.hold = hold
        self.fail: str | None = None  # "dead": the engine is gone; "error": the request fails
        self.aborted: list[str] = []
        self.closed: list[str] = []
        self.started: list[str] = []
        self.prompts: list[list[int]] = []
        self.arrivals: list[Any] = []
        self._abort_events: dict[str, asyncio.Event] = {}

    def abort(self, *request_ids: str) -> None:
        self.aborted.extend(request_ids)
        for rid in request_ids:
            event = self._abort_events.get(rid)
            if event is not None:
                event.set()

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, prompt: str | None = None, arrival: Any = None
                       ) -> AsyncIterator[RequestOutput]:
        self.started.append(request_id)
        self.prompts.append(list(prompt_token_ids))
        self.arrivals.append(arrival)
        self._abort_events[request_id] = event = asyncio.Event()
        if self.fail == "dead":
            raise EngineDeadError("the engine was shut down")
        if self.fail == "error":
            out = _delta(request_id, prompt_token_ids, params.n, "", None, "error")
            out.error = "the model produced garbage"
            yield out
            return
        try:
            for i in range(params.max_tokens):
                last = i == params.max_tokens - 1
                yield _delta(request_id, prompt_token_ids, params.n, f"t{i} ", i,
                             "length" if last else None)
                if self.hold:
                    await event.wait()
                    yield _delta(request_id, prompt_token_ids, params.n, "", None, "abort")
                    return
                await asyncio.sleep(0)
        finally:
            self.closed.append(request_id)


def _delta(request_id: str, prompt_ids: list[int], n: int, text: str, token: int | None,
           reason: str | None) -> RequestOutput:
    outputs = [CompletionOutput(index=i, text=text, token_ids=[] if token is None else [token],
                                finish_reason=reason) for i in range(n)]
    return RequestOutput(request_id, None, prompt_ids, outputs, finished=reason is not None)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from tidal.gpu.random_model import build_tokenizer
    return build_tokenizer()


async def _api_error(request: Any, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.to_dict(), status_code=exc.status)


def _client(tokenizer: Any, engine: ScriptedEngine, api_key: str | None = None,
            max_request_bytes: int = 1 << 20, max_model_len: int = 512,
            **settings: Any) -> TestClient:
    app = Starlette(routes=[Route("/", chat_page), WebSocketRoute(WS_PATH, chat_websocket),
                            Route("/v1/chat/completions", chat_completions, methods=["POST"])],
                    exception_handlers={ApiError: _api_error})
    app.state.tidal = ServerState(
        engine=engine, tokenizer=tokenizer,
        settings=ServerSettings(served_model_name="tiny", api_key=api_key,
                                max_request_bytes=max_request_bytes, **settings),
        metrics=ServerMetrics(), chat_template=ChatTemplate.for_tokenizer(tokenizer),
        max_model_len=max_model_len, vocab_size=len(tokenizer), kv_capacity_tokens=4096,
        max_num_seqs=8)
    return TestClient(app)


def _turn(ws: Any) -> tuple[list[dict], dict]:
    """Frames up to and including the turn's terminal frame."""
    deltas = []
    while True:
        frame = ws.receive_json()
        if frame["type"] == "delta":
            deltas.append(frame)
        else:
            return deltas, frame


def test_scripted_turns_stream_deltas_then_done(tokenizer: Any) -> None:
    engine = ScriptedEngine()
    with _client(tokenizer, engine) as client, client.websocket_connect(WS_PATH) as ws:
        ids = []
        for max_tokens in (3, 5):
            ws.send_json({"messages": HELLO, "max_tokens": max_tokens})
            deltas, done = _turn(ws)
            assert done["type"] == "done", done
            assert [d["text"] for d in deltas] == [f"t{i} " for i in range(max_tokens)]
            assert {d["id"] for d in deltas} == {done["id"]}
            assert done["finish_reason"] == "length" and done["model"] == "tiny"
            prompt_tokens = len(tokenizer.encode(
                ChatTemplate.for_tokenizer(tokenizer).render(HELLO), add_special_tokens=False))
            assert done["usage"] == {
                "prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                "total_tokens": prompt_tokens + max_tokens,
                "prompt_tokens_details": {"cached_tokens": 0}}
            ids.append(done["id"])
        assert ids[0] != ids[1] and engine.started == ids and engine.aborted == []


def test_scripted_turns_take_stream_options_without_stream(tokenizer: Any) -> None:
    """A turn always streams, so ``stream_options`` is valid with ``stream`` left out."""
    with _client(tokenizer, ScriptedEngine()) as client, \
            client.websocket_connect(WS_PATH) as ws:
        ws.send_json({"messages": HELLO, "max_tokens": 2,
                      "stream_options": {"include_usage": True}})
        deltas, done = _turn(ws)
        assert done["type"] == "done" and len(deltas) == 2, done


def test_scripted_n_choices_are_indexed(tokenizer: Any) -> None:
    with _client(tokenizer, ScriptedEngine()) as client, \
            client.websocket_connect(WS_PATH) as ws:
        ws.send_json({"type": "chat", "messages": HELLO, "max_tokens": 2, "n": 3})
        deltas, done = _turn(ws)
        assert sorted((d["index"], d["text"]) for d in deltas) == sorted(
            (i, f"t{t} ") for i in range(3) for t in range(2))
        assert done["choices"] == [{"index": i, "finish_reason": "length"} for i in range(3)]
        assert done["usage"]["completion_tokens"] == 6


def test_scripted_cancel_aborts_the_turn_in_flight(tokenizer: Any) -> None:
    engine = ScriptedEngine(hold=True)
    with _client(tokenizer, engine) as client, client.websocket_connect(WS_PATH) as ws:
        ws.send_json({"messages": HELLO, "max_tokens": 50})
        first = ws.receive_json()
        assert first["type"] == "delta" and first["text"] == "t0 "
        ws.send_json({"messages": HELLO})  # one turn at a time
        busy = ws.receive_json()
        assert busy["type"] == "error" and busy["error"]["code"] == "turn_in_flight"
        ws.send_json({"type": "cancel"})
        deltas, done = _turn(ws)
        assert deltas == [] and done["type"] == "done" and done["id"] == first["id"]
        assert done["finish_reason"] == "abort" and done["usage"]["completion_tokens"] == 1
        assert engine.aborted == [first["id"]]
        ws.send_json({"type": "cancel"})  # nothing in flight: ignored
        engine.hold = False
        ws.send_json({"messages": HELLO, "max_tokens": 2})
        deltas, done = _turn(ws)
        assert done["finish_reason"] == "length" and len(deltas) == 2
        assert engine.aborted == [first["id"]]


def test_scripted_closing_the_socket_leaves_the_stream(tokenizer: Any) -> None:
    engine = ScriptedEngine(hold=True)
    with _client(tokenizer, engine) as client:
        with client.websocket_connect(WS_PATH) as ws:
            ws.send_json({"messages": HELLO, "max_tokens": 50})
            first = ws.receive_json()
            assert first["type"] == "delta"
        # Leaving the socket cancels the turn's task, which closes the engine's stream
        # (the real engine aborts the request there).
        deadline = time.monotonic() + 10
        while not engine.closed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.closed == [first["id"]]


@pytest.mark.parametrize("frame, param, code", [
    ("not json", None, "invalid_frame"),
    ("[1, 2]", None, "invalid_frame"),
    ('{"type": "launch"}', "type", "invalid_frame"),
    ('{"max_tokens": 4}', "messages", None),
    ('{"messages": [{"role": "wizard", "content": "hi"}]}', "messages[0].role", None),
    ('{"messages": [{"role": "user", "content": "hi"}], "temperature": -1}', "temperature",
     None),
    ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}', "max_tokens",
     "context_length_exceeded"),
    ('{"messages": [{"role": "user", "content": "hi"}], "model": "other"}', "model",
     "model_not_found"),
])
def test_scripted_bad_frames_get_an_error_frame_and_the_socket_keeps_working(
        tokenizer: Any, frame: str, param: str | None, code: str | None) -> None:
    engine = ScriptedEngine()
    with _client(tokenizer, engine) as client, client.websocket_connect(WS_PATH) as ws:
        ws.send_text(frame)
        error = ws.receive_json()
        assert error["type"] == "error", error
        assert error["error"]["param"] == param and error["error"]["code"] == code
        assert error["error"]["message"] and error["error"]["type"] == "invalid_request_error"
        assert engine.started == []
        ws.send_json({"messages": HELLO, "max_tokens": 2})
        _, done = _turn(ws)
        assert done["type"] == "done" and done["usage"]["completion_tokens"] == 2


def test_scripted_engine_failures_end_the_turn_with_an_error_frame(tokenizer: Any) -> None:
    engine = ScriptedEngine()
    with _client(tokenizer, engine) as client, client.websocket_connect(WS_PATH) as ws:
        for fail, status_type in (("dead", "service_unavailable"), ("error", "server_error")):
            engine.fail = fail
            ws.send_json({"messages": HELLO, "max_tokens": 3})
            deltas, error = _turn(ws)
            assert deltas == [] and error["type"] == "error", error
            assert error["id"] == engine.started[-1]
            assert error["error"]["type"] == status_type and error["error"]["message"]
        engine.fail = None
        ws.send_json({"messages": HELLO, "max_tokens": 3})
        assert _turn(ws)[1]["usage"]["completion_tokens"] == 3


def test_scripted_oversized_frame_is_refused(tokenizer: Any) -> None:
    engine = ScriptedEngine()
    with _client(tokenizer, engine, max_request_bytes=300) as client, \
            client.websocket_connect(WS_PATH) as ws:
        ws.send_json({"messages": [{"role": "user", "content": "é" * 200}]})
        error = ws.receive_json()
        assert error["type"] == "error" and error["error"]["code"] == "request_too_large"
        assert engine.started == []
        ws.send_json({"messages": HELLO, "max_tokens": 1})
        assert _turn(ws)[1]["type"] == "done"


def test_scripted_api_key(tokenizer: Any) -> None:
    """The key comes in a header or the ``tidal-key.`` subprotocol, never in the URL."""
    with _client(tokenizer, ScriptedEngine(), api_key="se/s+a=me") as client:
        for path, headers, protocols in (
                (WS_PATH, {}, ["tidal"]), (WS_PATH + "?api_key=se/s+a=me", {}, []),
                (WS_PATH, {"Authorization": "Bearer wrong"}, []),
                (WS_PATH, {}, ["tidal", key_protocol("wrong")])):
            with client.websocket_connect(path, headers=headers, subprotocols=protocols) as ws:
                error = ws.receive_json()
                assert error["type"] == "error" and error["error"]["code"] == "invalid_api_key"
                with pytest.raises(Exception) as closed:
                    ws.receive_json()
                assert getattr(closed.value, "code", None) == 1008
        for headers, protocols in (({"Authorization": "Bearer se/s+a=me"}, []),
                                   ({}, ["tidal", key_protocol("se/s+a=me")])):
            with client.websocket_connect(WS_PATH, headers=headers,
                                          subprotocols=protocols) as ws:
                # the page's protocol is picked, so the key is never echoed back
                assert ws.accepted_subprotocol == ("tidal" if protocols else None)
                ws.send_json({"messages": HELLO, "max_tokens": 1})
                assert _turn(ws)[1]["type"] == "done"


def test_scripted_page_is_served(tokenizer: Any) -> None:
    with _client(tokenizer, ScriptedEngine()) as client:
        resp = client.get("/")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/html")
    assert WS_PATH in resp.text and "tiny" in resp.text
    assert "http://" not in resp.text and "https://" not in resp.text  # nothing from the net


# -- truncation: the oldest turns dropped to fit the context --------------------------------
SMALL_CONTEXT = 256
SYSTEM = {"role": "system", "content": "Be brief."}


def _conversation(turns: int) -> list[dict]:
    """``turns`` exchanges, then a new question; each exchange is about 50 tokens here."""
    messages = []
    for i in range(turns):
        messages += [{"role": "user", "content": f"Question {i} about the weather"},
                     {"role": "assistant", "content": f"Answer {i}: it is sunny"}]
    return [*messages, {"role": "user", "content": "And tomorrow?"}]


def _prompt_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    prompt = ChatTemplate.for_tokenizer(tokenizer).render(messages)
    return tokenizer.encode(prompt, add_special_tokens=False)


def test_scripted_truncation_drops_the_oldest_turns_to_fit(tokenizer: Any) -> None:
    engine = ScriptedEngine()
    conversation = _conversation(8)
    request = {"messages": [SYSTEM, *conversation], "max_tokens": 8}
    assert len(_prompt_ids(tokenizer, request["messages"])) + 8 > SMALL_CONTEXT
    with _client(tokenizer, engine, max_model_len=SMALL_CONTEXT) as client, \
            client.websocket_connect(WS_PATH) as ws:
        # Without truncation (the default, or "disabled") the request fails, as over HTTP.
        for extra in ({}, {"truncation": "disabled"}):
            ws.send_json(request | extra)
            deltas, error = _turn(ws)
            assert deltas == [] and error["type"] == "error", error
            assert error["error"]["code"] == "context_length_exceeded", error
        assert engine.started == []
        ws.send_json(request | {"truncation": "auto"})
        deltas, done = _turn(ws)
    assert done["type"] == "done" and len(deltas) == 8, done
    dropped = done["dropped_messages"]
    assert 0 < dropped < len(conversation) - 1 and dropped % 2 == 0  # whole turns
    # The engine got the system message and the newest turns, as few dropped as fit.
    kept = _prompt_ids(tokenizer, [SYSTEM, *conversation[dropped:]])
    assert engine.prompts == [kept] and done["usage"]["prompt_tokens"] == len(kept)
    assert len(kept) + 8 <= SMALL_CONTEXT
    assert len(_prompt_ids(tokenizer, [SYSTEM, *conversation[dropped - 2:]])) + 8 \
        > SMALL_CONTEXT


def test_scripted_truncation_without_max_tokens_leaves_room_for_a_reply(
        tokenizer: Any) -> None:
    engine = ScriptedEngine()
    conversation = _conversation(4)
    room = truncation_reserve(SMALL_CONTEXT)
    assert len(_prompt_ids(tokenizer, conversation)) + room > SMALL_CONTEXT
    with _client(tokenizer, engine, max_model_len=SMALL_CONTEXT) as client, \
            client.websocket_connect(WS_PATH) as ws:
        ws.send_json({"messages": conversation, "truncation": "auto"})
        deltas, done = _turn(ws)
    dropped = done["dropped_messages"]
    assert dropped > 0 and dropped % 2 == 0, done
    num_prompt = done["usage"]["prompt_tokens"]
    assert engine.prompts == [_prompt_ids(tokenizer, conversation[dropped:])]
    assert num_prompt + room <= SMALL_CONTEXT
    assert len(_prompt_ids(tokenizer, conversation[dropped - 2:])) + room > SMALL_CONTEXT
    # the reply may use all the room left, as without truncation
    assert done["usage"]["completion_tokens"] == len(deltas) == SMALL_CONTEXT - num_prompt


def test_scripted_truncation_keeps_a_conversation_that_fits(tokenizer: Any) -> None:
    engine = ScriptedEngine()
    messages = [SYSTEM, *_conversation(1)]
    with _client(tokenizer, engine, max_model_len=SMALL_CONTEXT) as client, \
            client.websocket_connect(WS_PATH) as ws:
        ws.send_json({"messages": messages, "max_tokens": 3, "truncation": "auto"})
        _, done = _turn(ws)
        assert done["dropped_messages"] == 0
        ws.send_json({"messages": messages, "max_tokens": 3})
        _, plain = _turn(ws)
        assert "dropped_messages" not in plain  # a frame without truncation is as before
    assert engine.prompts == [_prompt_ids(tokenizer, messages)] * 2


def test_scripted_truncation_cuts_before_a_user_message(tokenizer: Any) -> None:
    """A conversation that opens with the assistant, two assistant messages in a row, a
    system message midway: the cut drops whole turns, so the kept messages start with a user
    message, and every system message stays."""
    engine = ScriptedEngine()
    note = {"role": "system", "content": "Answer in French."}
    messages = [{"role": "assistant", "content": "Good morrow! Ask me about the weather."},
                *_conversation(5)[:-1], note,
                {"role": "assistant", "content": "Also: bring an umbrella, just in case."},
                {"role": "user", "content": "Why?"}]
    with _client(tokenizer, engine, max_model_len=SMALL_CONTEXT) as client, \
            client.websocket_connect(WS_PATH) as ws:
        ws.send_json({"messages": messages, "max_tokens": 60, "truncation": "auto"})
        _, done = _turn(ws)
    dropped = done["dropped_messages"]
    others = [m for m in messages if m["role"] != "system"]
    kept = [m for m in messages if m["role"] == "system" or m in others[dropped:]]
    assert dropped > 0 and others[dropped]["role"] == "user" and note in kept, done
    assert engine.prompts == [_prompt_ids(tokenizer, kept)]
    assert len(engine.prompts[0]) + 60 <= SMALL_CONTEXT


def test_scripted_truncation_cannot_shorten_the_last_message(tokenizer: Any) -> None:
    engine = ScriptedEngine()
    with _client(tokenizer, engine, max_model_len=SMALL_CONTEXT) as client, \
            client.websocket_connect(WS_PATH) as ws:
        long = [*_conversation(2)[:-1], {"role": "user", "content": "why " * 100}]
        ws.send_json({"messages": long, "truncation": "auto"})
        _, error = _turn(ws)
        assert error["type"] == "error" and error["error"]["code"] == "context_length_exceeded"
        ws.send_json({"messages": HELLO, "truncation": "sometimes"})
        _, error = _turn(ws)
        assert error["type"] == "error" and error["error"]["param"] == "truncation", error
        # When dropping every earlier turn still leaves less room than wanted, the last
        # message goes alone and gets the room there is.
        medium = [*_conversation(2)[:-1], {"role": "user", "content": "why " * 50}]
        assert SMALL_CONTEXT - len(_prompt_ids(tokenizer, medium[-1:])) < truncation_reserve(
            SMALL_CONTEXT)
        ws.send_json({"messages": medium, "truncation": "auto"})
        _, done = _turn(ws)
        assert done["type"] == "done" and done["dropped_messages"] == len(medium) - 1, done
        assert engine.prompts == [_prompt_ids(tokenizer, medium[-1:])]
        assert done["usage"]["total_tokens"] == SMALL_CONTEXT
    assert len(engine.started) == 1


def test_http_chat_completions_does_not_truncate(tokenizer: Any) -> None:
    """OpenAI's chat completions refuse a conversation too long for the context with a 400;
    so does /v1/chat/completions, "truncation" or not (it is a websocket field)."""
    engine = ScriptedEngine()
    with _client(tokenizer, engine, max_model_len=SMALL_CONTEXT) as client:
        for extra in ({}, {"truncation": "auto"}):
            resp = client.post("/v1/chat/completions", json={
                "model": "tiny", "messages": _conversation(8), "max_tokens": 8} | extra)
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"]["code"] == "context_length_exceeded"
    assert engine.started == []


# -- admission control, client identity, preparation off the loop ---------------------------
def _admitted(client: TestClient) -> tuple[float, float]:
    """The admission gauges: sequences reserved, clients holding some."""
    registry = client.app.state.tidal.metrics.registry
    return (registry.get_sample_value("tidal:admitted_sequences"),
            registry.get_sample_value("tidal:admitted_clients"))


def _wait(check: Any, what: str, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_scripted_refused_turn_gets_a_429_frame_and_the_socket_retries(
        tokenizer: Any) -> None:
    """The server's queue is full (8 sequences, none waiting): the next turn gets a 429
    error frame with ``retry_after``; the socket stays open, and the same request goes
    through once the first turn ends."""
    engine = ScriptedEngine(hold=True)
    with _client(tokenizer, engine, max_waiting_seqs=0, fair_share_by="user") as client, \
            client.websocket_connect(WS_PATH) as first, \
            client.websocket_connect(WS_PATH) as second:
        first.send_json({"messages": HELLO, "max_tokens": 50, "n": 8, "user": "a"})
        held = [first.receive_json() for _ in range(8)]
        assert {f["type"] for f in held} == {"delta"}, held
        assert _admitted(client) == (8, 1)
        second.send_json({"messages": HELLO, "max_tokens": 2, "user": "b"})
        deltas, refused = _turn(second)
        assert deltas == [] and refused["type"] == "error", refused
        assert refused["error"]["type"] == "rate_limit_error"
        assert refused["error"]["code"] == "rate_limit_exceeded"
        assert refused["retry_after"] == 1 and refused["id"].startswith("chatcmpl-")
        assert refused["id"] not in engine.started and _admitted(client) == (8, 1)
        first.send_json({"type": "cancel"})
        _, done = _turn(first)
        assert done["finish_reason"] == "abort"
        assert _admitted(client) == (0, 0)  # given back before the done frame left
        engine.hold = False
        second.send_json({"messages": HELLO, "max_tokens": 2, "user": "b"})
        deltas, done = _turn(second)
        assert done["type"] == "done" and len(deltas) == 2, done
        registry = client.app.state.tidal.metrics.registry
        assert registry.get_sample_value("tidal:requests_rejected_total",
                                         {"reason": "server"}) == 1
    assert _admitted(client) == (0, 0)


def test_scripted_admission_is_given_back_however_a_turn_ends(tokenizer: Any) -> None:
    engine = ScriptedEngine()
    with _client(tokenizer, engine) as client:
        with client.websocket_connect(WS_PATH) as ws:
            ws.send_json({"messages": HELLO, "max_tokens": 2, "n": 3})  # finished
            assert _turn(ws)[1]["type"] == "done"
            assert _admitted(client) == (0, 0)
            engine.fail = "error"  # failed in the engine
            ws.send_json({"messages": HELLO, "max_tokens": 2})
            assert _turn(ws)[1]["type"] == "error"
            assert _admitted(client) == (0, 0)
            engine.fail, engine.hold = None, True  # cancelled
            ws.send_json({"messages": HELLO, "max_tokens": 50, "n": 2})
            assert ws.receive_json()["type"] == "delta"
            assert _admitted(client) == (2, 1)
            ws.send_json({"type": "cancel"})
            assert _turn(ws)[1]["finish_reason"] == "abort"
            assert _admitted(client) == (0, 0)
            ws.send_json({"messages": HELLO, "max_tokens": 50, "n": 4})  # the client leaves
            assert ws.receive_json()["type"] == "delta"
            assert _admitted(client) == (4, 1)
        _wait(lambda: len(engine.closed) == 3, "the engine's stream closed")
        _wait(lambda: _admitted(client) == (0, 0), "the reservation given back")


def test_scripted_turns_carry_their_client(tokenizer: Any) -> None:
    """The turn's client reaches the engine on ``Arrival.client``, by --fair-share-by as over
    HTTP: the key from the header or the subprotocol counts as the same client."""
    def hashed(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    cases = [("address", {}, [], {}, "testclient"),
             ("api-key", {"Authorization": "Bearer k/e+y="}, [], {}, hashed("k/e+y=")),
             ("api-key", {}, ["tidal", key_protocol("k/e+y=")], {}, hashed("k/e+y=")),
             ("api-key", {}, [], {}, ""),
             ("user", {}, [], {"user": "alice"}, "alice"),
             ("none", {}, [], {"user": "alice"}, "")]
    for fair_share_by, headers, protocols, extra, expected in cases:
        engine = ScriptedEngine()
        with _client(tokenizer, engine, fair_share_by=fair_share_by) as client, \
                client.websocket_connect(WS_PATH, headers=headers,
                                         subprotocols=protocols) as ws:
            ws.send_json({"messages": HELLO, "max_tokens": 1, "timeout": 30} | extra)
            assert _turn(ws)[1]["type"] == "done"
        [arrival] = engine.arrivals
        assert arrival.client == expected, fair_share_by
        assert arrival.timeout == 30 and arrival.tokenized >= arrival.time


def test_scripted_turns_are_prepared_on_the_pool(tokenizer: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Templating and tokenizing run on the prepare pool; the reader keeps reading frames
    meanwhile: a cancel while the turn is prepared ends it without queueing anything."""
    threads: list[str] = []
    release = threading.Event()
    prepare = websocket_module.prepare_chat_request

    def slow_prepare(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        release.wait(10)
        return prepare(*args, **kwargs)

    monkeypatch.setattr(websocket_module, "prepare_chat_request", slow_prepare)
    engine = ScriptedEngine()
    with _client(tokenizer, engine) as client, client.websocket_connect(WS_PATH) as ws:
        ws.send_json({"messages": HELLO, "max_tokens": 2})
        ws.send_json({"messages": HELLO})  # read while the first is prepared
        busy = ws.receive_json()
        assert busy["type"] == "error" and busy["error"]["code"] == "turn_in_flight", busy
        ws.send_json({"type": "cancel"})
        _wait(lambda: threads, "the turn being prepared")
        release.set()
        deltas, done = _turn(ws)
        assert deltas == [] and done["finish_reason"] == "abort", done
        assert engine.started == [] and _admitted(client) == (0, 0)
        ws.send_json({"messages": HELLO, "max_tokens": 2})
        assert _turn(ws)[1]["type"] == "done"
        # a frame over 64 KiB is parsed on the pool too
        ws.send_json({"messages": HELLO, "max_tokens": 2, "padding": "x" * (100 << 10)})
        assert _turn(ws)[1]["type"] == "done"
        ws.send_text("{" * (100 << 10))
        error = ws.receive_json()
        assert error["type"] == "error" and error["error"]["code"] == "invalid_frame"
    assert len(threads) == 3 and all(t.startswith("tidal-prepare") for t in threads), threads
