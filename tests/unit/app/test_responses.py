"""The Responses API's translations, without an engine: ``input`` items into chat messages, a
Responses request into the chat request it runs as (errors named by the Responses field, the
rendered prompt of a follow-up), and the bounded response store. The output items and events:
``test_responses_events.py``."""

from __future__ import annotations

from typing import Any

import pytest

from tidal.app.errors import ApiError
from tidal.app.response_store import ResponseStore
from tidal.app.responses_input import input_messages
from tidal.app.responses_output import ResponseBuilder, response_usage
from tidal.app.responses_request import prepare_response_request, responses_param
from tidal.app.server_state import ServerState

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


# -- input items -> chat messages ----------------------------------------------------------------
def test_a_string_is_one_user_message() -> None:
    assert input_messages("Hi") == [{"role": "user", "content": "Hi"}]


def test_items_become_chat_messages() -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "one"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "two"}]},
        {"type": "function_call", "call_id": "call_3", "name": "f", "arguments": ""},
    ]
    assert input_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"},
                                     {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}],
         "tool_calls": [
             {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
             {"id": "call_2", "type": "function",
              "function": {"name": "g", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "one"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "two"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_3", "type": "function", "function": {"name": "f", "arguments": ""}}]},
    ]


@pytest.mark.parametrize("value,param", [
    (3, "input"),
    (["hi"], "input[0]"),
    ([{"role": "robot", "content": "x"}], "input[0].role"),
    ([{"role": "user"}], "input[0].content"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
     "input[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "input_text", "text": 5}]}],
     "input[0].content[0].text"),
    ([{"role": "user", "content": "x"}, {"type": "web_search_call"}], "input[1].type"),
    ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id"),
    ([{"type": "function_call", "call_id": "c", "arguments": "{}"}], "input[0].name"),
    ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}],
     "input[0].arguments"),
    ([{"type": "function_call_output", "call_id": "c", "output": 5}], "input[0].output"),
])
def test_bad_items_are_named(value: Any, param: str) -> None:
    with pytest.raises(ApiError) as info:
        input_messages(value)
    assert (info.value.status, info.value.param) == (400, param)


# -- the request as a chat request ---------------------------------------------------------------
def test_chat_field_names_become_responses_names() -> None:
    assert responses_param("max_completion_tokens") == "max_output_tokens"
    assert responses_param("response_format.json_schema.schema") == "text.format.schema"
    assert responses_param("response_format.type") == "text.format.type"
    assert responses_param("messages[3].content") == "input"
    assert responses_param("tools[1].function.parameters") == "tools[1].parameters"
    assert responses_param("temperature") == "temperature"


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": "8"}, "max_output_tokens"),
    ({}, "input"),
    ({"input": "x", "model": "other"}, "model"),
    ({"input": "x", "temperature": -1.0}, "temperature"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": 3}}},
     "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "x", "tools": [{"type": "function", "name": ""}]}, "tools[0].name"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": []}]},
     "tools[0].parameters"),
    ({"input": "x", "tools": TOOLS * 2}, "tools"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ({"input": "x", "tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": "x", "background": True}, "background"),
])
def test_bad_requests_name_the_responses_field(hermes_state: ServerState,
                                               body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as info:
        prepare_response_request(body, hermes_state)
    assert info.value.param == param, info.value.message
    assert info.value.status == (404 if param == "model" else 400)


def test_the_request_runs_as_its_chat_request(hermes_state: ServerState) -> None:
    body = {"instructions": "Be brief.", "input": "Weather?", "max_output_tokens": 9,
            "temperature": 0.5, "top_p": 0.9, "tools": TOOLS, "seed": 3,
            "tool_choice": {"type": "function", "name": "get_weather"}}
    prep = prepare_response_request(body, hermes_state).chat
    assert prep.prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '"name": "get_weather"' in prep.prompt and prep.prompt.endswith(
        "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n")
    assert prep.prompt_token_ids == hermes_state.tokenizer.encode(prep.prompt,
                                                                  add_special_tokens=False)
    params = prep.params
    assert (params.max_tokens, params.temperature, params.top_p, params.seed) == (9, 0.5, 0.9, 3)
    assert params.structured_outputs is not None and prep.tool_use is not None
    assert prep.tool_use.tools[0]["function"]["parameters"] == WEATHER


def _answer(spec: Any) -> dict[str, Any]:
    """What a constraint holds the answer to, after the thinking it follows."""
    return spec.structural_tag["format"]["elements"][-1]


def test_text_format_constrains_the_reply(hermes_state: ServerState) -> None:
    fmt = {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}
    spec = prepare_response_request({"input": "x", "text": {"format": fmt}},
                                    hermes_state).params.structured_outputs
    # the answer after the thinking (the state's reasoning parser is qwen3's)
    assert spec is not None and _answer(spec) == {"type": "json_schema", "json_schema": WEATHER}
    assert spec.field == "response_format.json_schema.schema"  # renamed when it fails
    spec = prepare_response_request({"input": "x", "text": {"format": {"type": "json_object"}}},
                                    hermes_state).params.structured_outputs
    assert spec is not None and _answer(spec) == {"type": "json_schema",
                                                  "json_schema": {"type": "object"}}
    assert prepare_response_request({"input": "x", "text": {"format": {"type": "text"}}},
                                    hermes_state).params.structured_outputs is None


def test_a_follow_up_continues_the_stored_conversation(hermes_state: ServerState) -> None:
    """The earlier input, its call and the call's output all reach the prompt; the earlier
    instructions do not."""
    first = prepare_response_request({"instructions": "Old rules.", "input": "Weather?",
                                      "tools": TOOLS}, hermes_state)
    builder = ResponseBuilder(first)
    builder.feed("<think>hm</think>" + CALL, "stop")
    (done,) = [e for e in builder.finish(response_usage(1, 1, 0, 0))
               if e["type"] == "response.completed"]
    hermes_state.responses.put(done["response"], first.conversation + input_messages(
        done["response"]["output"]))
    call = done["response"]["output"][-1]
    follow = prepare_response_request({
        "previous_response_id": first.id, "instructions": "New rules.", "tools": TOOLS,
        "input": [{"type": "function_call_output", "call_id": call["call_id"],
                   "output": "Sunny"}]}, hermes_state)
    prompt = follow.chat.prompt
    assert "Old rules." not in prompt and "New rules." in prompt and "hm" not in prompt
    turns = prompt[prompt.index("</tools>"):]
    assert turns.index("<|im_start|>user\nWeather?") < turns.index(
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>') < turns.index(
        "<|im_start|>user\n<tool_response>\nSunny\n</tool_response><|im_end|>")
    with pytest.raises(ApiError) as info:
        prepare_response_request({"previous_response_id": "resp_gone", "input": "x"},
                                 hermes_state)
    assert (info.value.status, info.value.param) == (404, "previous_response_id")


# -- the store -----------------------------------------------------------------------------------
def _response(i: int, text: str = "") -> dict[str, Any]:
    return {"id": f"resp_{i}", "object": "response", "output": [], "text": text}


def test_the_store_evicts_the_oldest_past_its_entries() -> None:
    store = ResponseStore(max_entries=3, max_bytes=1 << 20)
    for i in range(5):
        assert store.put(_response(i), [{"role": "user", "content": str(i)}])
    assert [store.get(f"resp_{i}") is not None for i in range(5)] == [False, False, True, True,
                                                                      True]
    assert store.get("resp_4").conversation == [{"role": "user", "content": "4"}]
    assert store.delete("resp_3") and not store.delete("resp_3") and len(store) == 2


def test_the_store_evicts_the_oldest_past_its_bytes() -> None:
    store = ResponseStore(max_entries=100, max_bytes=1000)
    for i in range(4):
        store.put(_response(i, "x" * 250), [])
    assert [store.get(f"resp_{i}") is not None for i in range(4)] == [False, True, True, True]
    assert store.bytes <= 1000
    assert not store.put(_response(9, "x" * 2000), []) and store.get("resp_9") is None
    store.put(_response(1, "y"), [])  # replacing an entry counts its bytes once
    assert len(store) == 3 and store.bytes == sum(
        store.get(f"resp_{i}").size for i in (1, 2, 3))
