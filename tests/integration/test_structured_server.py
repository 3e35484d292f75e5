"""Structured outputs and tool calls through the real server: ``response_format`` and vLLM's
``structured_outputs`` on chat, completions and the websocket, ``tools`` with every
``tool_choice`` over a Hermes-style chat template, streamed and not, through ``curl`` and the
official ``openai`` client (its ``parse`` and its streamed tool-call assembly)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Literal

import jsonschema
import openai
import pytest
import websockets
from pydantic import BaseModel, Field

from tests.live_server import Server, curl, running_server, sse_events
from tidal.gpu.random_model import build_model_dir
from tidal.templates import TEMPLATES_DIR

pytestmark = [pytest.mark.gpu, pytest.mark.integration]
NUM_SAMPLES = 50
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit"], "additionalProperties": False}
SEARCH = {"type": "object",
          "properties": {"query": {"type": "string", "maxLength": 16},
                         "filters": {"type": "array", "maxItems": 2,
                                     "items": {"type": "string", "maxLength": 6}}},
          "required": ["query"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "parameters": SEARCH}}]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]


class Character(BaseModel):
    name: str = Field(max_length=12)
    level: int = Field(ge=0, le=99)
    kind: Literal["knight", "fool", "king"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = build_model_dir(tmp_path_factory.mktemp("so") / "tiny", "llama",
                            max_position_embeddings=2048,
                            added_tokens=("<tool_call>", "</tool_call>"))
    with running_server(model, "--kv-cache-memory", "32MiB", "--chat-template",
                        str(TEMPLATES_DIR / "hermes_tools.jinja")) as srv:
        yield Server(srv.url, srv.port, str(model))


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return server.openai()


def _check_calls(message, names: set[str]) -> None:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# -- response_format and structured_outputs -----------------------------------------------------
@pytest.mark.slow
def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=client.models.list().data[0].id, messages=CHAT, response_format=Character,
        temperature=1.0, seed=3, n=NUM_SAMPLES, max_tokens=80)
    assert len(completion.choices) == NUM_SAMPLES
    for choice in completion.choices:
        assert isinstance(choice.message.parsed, Character), choice.message.content


def test_json_object_on_completions_streamed_equals_whole(server: Server) -> None:
    body = {"model": server.model, "prompt": "Data:", "max_tokens": 120, "temperature": 0.0,
            "response_format": {"type": "json_object"}}
    whole = server.post("/v1/completions", body).json()["choices"][0]
    events = sse_events(curl(f"{server.url}/v1/completions", "-H",
                             "content-type: application/json",
                             "-d", json.dumps({**body, "stream": True})))
    streamed = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    assert streamed == whole["text"] and whole["text"].startswith("{")
    if whole["finish_reason"] == "stop":
        assert isinstance(json.loads(whole["text"]), dict)


@pytest.mark.parametrize("constraint,check", [
    ({"regex": r"(Sir|Lady) [A-Z][a-z]{1,8}"},
     lambda t: re.fullmatch(r"(Sir|Lady) [A-Z][a-z]{1,8}", t)),
    ({"choice": ["yes", "no", "perhaps"]}, lambda t: t in ("yes", "no", "perhaps")),
    ({"json": WEATHER}, lambda t: jsonschema.validate(json.loads(t), WEATHER) is None),
])
def test_vllm_structured_outputs(client: openai.OpenAI, constraint, check) -> None:
    completion = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=CHAT, temperature=1.0, seed=5,
        n=NUM_SAMPLES, max_tokens=80, extra_body={"structured_outputs": constraint})
    for choice in completion.choices:
        assert choice.finish_reason == "stop" and check(choice.message.content), choice


def test_response_format_on_the_websocket(server: Server) -> None:
    async def turn() -> str:
        url = server.url.replace("http://", "ws://") + "/v1/chat/ws"
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps({"messages": CHAT, "max_tokens": 80, "temperature": 0.0,
                                      "response_format": {"type": "json_schema", "json_schema": {
                                          "name": "w", "schema": WEATHER}}}))
            text = ""
            while True:
                frame = json.loads(await ws.recv())
                if frame["type"] == "delta":
                    text += frame["text"]
                if frame["type"] in ("done", "error"):
                    assert frame["type"] == "done", frame
                    return text

    jsonschema.validate(json.loads(asyncio.run(turn())), WEATHER)


# -- tools --------------------------------------------------------------------------------------
@pytest.mark.parametrize("tool_choice,names", [
    ({"type": "function", "function": {"name": "search"}}, {"search"}),
    ("required", {"get_weather", "search"}),
])
def test_forced_tool_calls_always_parse(client: openai.OpenAI, tool_choice, names) -> None:
    """One call each: every reply is exactly a call that parses and validates."""
    completion = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=CHAT, tools=TOOLS,
        tool_choice=tool_choice, parallel_tool_calls=False, temperature=1.0, seed=11,
        n=NUM_SAMPLES, max_tokens=300)
    for choice in completion.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert not choice.message.content and len(choice.message.tool_calls) == 1
        _check_calls(choice.message, names)


@pytest.mark.slow
def test_parallel_tool_calls_each_parse(client: openai.OpenAI) -> None:
    """Several calls a reply: a reply may run into max_tokens in a later call, but every
    call it returns parses and validates."""
    completion = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=CHAT, tools=TOOLS,
        tool_choice="required", temperature=1.0, seed=12, n=NUM_SAMPLES, max_tokens=300)
    for choice in completion.choices:
        assert choice.finish_reason in ("tool_calls", "length"), choice
        _check_calls(choice.message, set(SCHEMAS))


def test_streamed_tool_calls_equal_the_whole_reply(client: openai.OpenAI) -> None:
    fields = dict(model=client.models.list().data[0].id, messages=CHAT, tools=TOOLS,
                  tool_choice="required", temperature=0.0, max_tokens=200)
    whole = client.chat.completions.create(**fields).choices[0]
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(**fields, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for part in choice.delta.tool_calls or []:
                call = calls.setdefault(part.index, {"id": part.id, "name": "", "args": ""})
                call["name"] += (part.function.name or "") if part.function else ""
                call["args"] += (part.function.arguments or "") if part.function else ""
    assert finish == whole.finish_reason == "tool_calls" and content == ""
    assert [(c["name"], c["args"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


@pytest.mark.slow
def test_auto_calls_parse_whenever_the_trigger_appears(server: Server,
                                                       client: openai.OpenAI) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(server.model)
    (trigger,) = tokenizer.encode("<tool_call>", add_special_tokens=False)  # one, as Qwen's
    completion = client.chat.completions.create(
        model=server.model, messages=CHAT, tools=TOOLS, temperature=1.0, seed=2,
        n=NUM_SAMPLES, max_tokens=160, logit_bias={str(trigger): 6})
    called = 0
    for choice in completion.choices:
        if choice.finish_reason != "length":  # a call cut short stays text, as OpenAI's
            assert "<tool_call>" not in (choice.message.content or "")
        if choice.message.tool_calls:
            called += 1
            _check_calls(choice.message, set(SCHEMAS))
            assert choice.finish_reason in ("tool_calls", "length")
    assert called >= NUM_SAMPLES // 5


def test_a_conversation_with_a_tool_result(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    first = client.chat.completions.create(
        model=model, messages=CHAT, tools=TOOLS, tool_choice="required", temperature=0.0,
        max_tokens=200).choices[0].message
    call = first.tool_calls[0]
    messages = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                           tool_choice="none", max_tokens=16)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert not reply.choices[0].message.tool_calls


# -- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_constraints_are_400s_naming_the_field(server: Server, fields, param) -> None:
    for stream in (False, True):
        resp = server.post("/v1/chat/completions", {"model": server.model, "messages": CHAT,
                                                    "stream": stream, **fields})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param
    assert server.chat(max_tokens=4)["choices"][0]["finish_reason"] in ("stop", "length")
