"""The Responses API's output: a reply's text as output items and typed stream events, fed in
any chunking, checked against the official ``openai`` client's event models and its stream
accumulator."""

from __future__ import annotations

import random
import re
from typing import Any

import openai
import pydantic
import pytest
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from tidal.app.responses_output import ResponseBuilder, response_usage
from tidal.app.responses_request import prepare_response_request
from tidal.app.server_state import ServerState

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)
# each event type as one letter, and the order OpenAI sends them in
LETTERS = {"response.created": "C", "response.in_progress": "P",
           "response.output_item.added": "A", "response.content_part.added": "[",
           "response.output_text.delta": "t", "response.output_text.done": "T",
           "response.reasoning_text.delta": "r", "response.reasoning_text.done": "R",
           "response.content_part.done": "]", "response.output_item.done": "D",
           "response.function_call_arguments.delta": "f",
           "response.function_call_arguments.done": "F", "response.completed": "Z",
           "response.incomplete": "I"}
ORDER = re.compile(r"CP(A\[(t*T|r*R)\]D|AfFD)*[ZI]")


def _run(builder: ResponseBuilder, text: str, finish: str, cuts: list[int]) -> list[dict]:
    """All events of a reply fed in pieces that end at ``cuts``."""
    events = builder.start()
    ends = sorted(set(cuts)) + [len(text)]
    start = 0
    for end in ends:
        last = end == len(text)
        events += builder.feed(text[start:end], finish if last else None)
        start = end
    return events + builder.finish(response_usage(5, 7, 0, 0))


def _check_events(events: list[dict]) -> dict[str, Any]:
    """The events in OpenAI's order, numbered, each one the client's model; each item's
    deltas add up to its done text; the client's stream accumulator agrees. Returns the
    final response."""
    letters = "".join(LETTERS[e["type"]] for e in events)
    assert ORDER.fullmatch(letters), letters
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        EVENTS.validate_python(event)
    texts: dict[int, str] = {}
    open_item: dict[str, Any] = {}
    for e in events:
        if e["type"] == "response.output_item.added":
            open_item = {"id": e["item"]["id"], "index": e["output_index"]}
            assert e["output_index"] == len(texts)
            texts[e["output_index"]] = ""
        elif "item_id" in e:
            assert (e["item_id"], e["output_index"]) == (open_item["id"], open_item["index"])
        if e["type"].endswith("text.delta") or e["type"].endswith("arguments.delta"):
            texts[e["output_index"]] += e["delta"]
        if e["type"].endswith("text.done"):
            assert e["text"] == texts[e["output_index"]]
        if e["type"].endswith("arguments.done"):
            assert e["arguments"] == texts[e["output_index"]]
    final = events[-1]["response"]
    assert len(final["output"]) == len(texts)
    client = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    for event in events:
        client.handle_event(EVENTS.validate_python(event))
    return final


def _shape(output: list[dict]) -> list[tuple]:
    """The items without their ids."""
    shapes = []
    for item in output:
        if item["type"] == "function_call":
            shapes.append((item["type"], item["name"], item["arguments"], item["status"]))
        else:
            shapes.append((item["type"], item["status"], [p["text"] for p in item["content"]]))
    return shapes


@pytest.mark.parametrize("seed", range(6))
def test_reasoning_answer_and_call_in_any_chunking(hermes_state: ServerState, seed: int) -> None:
    prep = prepare_response_request({"input": "x", "tools": TOOLS}, hermes_state)
    text = "<think>Rain, or sun?</think>\n\nLet me check. " + CALL
    cuts = random.Random(seed).sample(range(1, len(text)), k=min(seed * 7, len(text) - 1))
    builder = ResponseBuilder(prep)
    final = _check_events(_run(builder, text, "stop", cuts))
    assert final["status"] == "completed" and final["incomplete_details"] is None
    assert _shape(final["output"]) == [
        ("reasoning", "completed", ["Rain, or sun?"]),
        ("message", "completed", ["Let me check."]),
        ("function_call", "get_weather", '{"city": "Paris"}', "completed")]
    assert final["output"][2]["call_id"].startswith("call_")
    assert builder.reasoning == "Rain, or sun?"
    assert final["usage"] == response_usage(5, 7, 0, 0) and final["usage"]["total_tokens"] == 12


def test_a_reply_cut_by_max_output_tokens_is_incomplete(hermes_state: ServerState) -> None:
    prep = prepare_response_request({"input": "x", "tools": TOOLS}, hermes_state)
    final = _check_events(_run(ResponseBuilder(prep), "Hello" + CALL[:30], "length", [3, 9]))
    assert (final["status"], final["incomplete_details"]) == (
        "incomplete", {"reason": "max_output_tokens"})
    assert _shape(final["output"]) == [("message", "incomplete", ["Hello"])]  # no half call


def test_a_call_alone_has_no_message_and_silence_has_an_empty_one(hermes_state: ServerState
                                                                   ) -> None:
    prep = prepare_response_request({"input": "x", "tools": TOOLS}, hermes_state)
    final = _check_events(_run(ResponseBuilder(prep), CALL, "stop", [12]))
    assert [item["type"] for item in final["output"]] == ["function_call"]
    final = _check_events(_run(ResponseBuilder(prep), "", "stop", []))
    assert _shape(final["output"]) == [("message", "completed", [""])]


def test_plain_text_without_tools_or_thinking(hermes_state: ServerState) -> None:
    hermes_state.settings.reasoning_parser = "none"
    prep = prepare_response_request({"input": "x"}, hermes_state)
    text = "<think>not split</think> <tool_call>{}</tool_call>"
    final = _check_events(_run(ResponseBuilder(prep), text, "stop", [4, 20]))
    assert _shape(final["output"]) == [("message", "completed", [text])]


def test_a_failure_is_a_failed_response(hermes_state: ServerState) -> None:
    builder = ResponseBuilder(prepare_response_request({"input": "x"}, hermes_state))
    events = builder.start() + builder.feed("Hel")
    failed = builder.failed("the engine died", response_usage(1, 1, 0, 0))
    EVENTS.validate_python(failed)
    assert failed["sequence_number"] == events[-1]["sequence_number"] + 1
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "server_error", "message": "the engine died"}
