"""The websocket chat splits a reply as the HTTP chat does: a reasoning model's thinking in
the delta frames' ``reasoning``, tool calls in their ``tool_calls`` fragments, the answer
alone in ``text``; the frames add up to the HTTP chat's whole message for the same request."""

from __future__ import annotations

from typing import Any

import orjson

from tests.unit.app.test_reasoning import ANSWER, chat_client  # noqa: F401 - a fixture

TOOL = {"type": "function", "function": {"name": "ask", "parameters": ANSWER}}


def _body(client: Any, seed: int, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "Ask."}],
            "max_tokens": 80, "temperature": 1.0, "seed": seed,
            "chat_template_kwargs": {"opening": "maybe"},
            "logit_bias": {str(i): 6 for i in client.marker_ids}, **extra}


def _turn(client: Any, body: dict[str, Any]) -> tuple[list[dict], dict]:
    with client.websocket_connect("/v1/chat/ws") as ws:
        ws.send_text(orjson.dumps(body).decode())
        frames = []
        while True:
            frame = orjson.loads(ws.receive_text())
            if frame["type"] != "delta":
                return frames, frame
            frames.append(frame)


def _joined(frames: list[dict]) -> dict[str, Any]:
    """The message the delta frames add up to."""
    reasoning = "".join(f.get("reasoning", "") for f in frames) or None
    calls: dict[int, dict] = {}
    for fragment in (c for f in frames for c in f.get("tool_calls", [])):
        call = calls.setdefault(fragment["index"], {"id": fragment.get("id"),
                                                   "type": "function",
                                                   "function": {"name": "", "arguments": ""}})
        for key, value in fragment.get("function", {}).items():
            call["function"][key] += value
    message = {"role": "assistant", "reasoning_content": reasoning,
               "content": "".join(f["text"] for f in frames) or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def test_thinking_and_a_tool_call_arrive_apart_as_over_http(chat_client):  # noqa: F811
    chat_client.app.state.tidal.settings.reasoning_parser = None  # the template's: qwen3
    thought = 0
    for seed in range(4):
        body = _body(chat_client, seed, tools=[TOOL], tool_choice={
            "type": "function", "function": {"name": "ask"}})
        frames, done = _turn(chat_client, body)
        choice = chat_client.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert done["type"] == "done" and done["finish_reason"] == choice["finish_reason"] \
            == "tool_calls"
        assert _without_ids(_joined(frames)) == _without_ids(choice["message"])
        assert not any(f["text"] for f in frames)  # no call markup in the text
        thought += choice["message"]["reasoning_content"] is not None
    assert thought >= 2


def test_a_thinking_reply_with_a_schema_arrives_apart(chat_client):  # noqa: F811
    chat_client.app.state.tidal.settings.reasoning_parser = None
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}
    for seed in range(3):
        body = _body(chat_client, seed, response_format=schema)
        frames, done = _turn(chat_client, body)
        message = chat_client.post("/v1/chat/completions", json=body).json()[
            "choices"][0]["message"]
        assert done["finish_reason"] == "stop"
        assert _joined(frames) == message
        assert orjson.loads(message["content"]).keys() == {"ok"}


def _without_ids(message: dict[str, Any]) -> dict[str, Any]:
    """Each request names its calls afresh."""
    calls = [{**c, "id": None} for c in message.get("tool_calls", [])]
    return {**message, "tool_calls": calls}
