"""The Responses API through the official ``openai`` client against the real server process:
plain text (the same reply as the chat endpoint's), the typed event stream through
``create(stream=True)`` and the ``responses.stream`` helper, ``text.format`` JSON, a function
call and its output carried to a follow-up by ``previous_response_id``, reasoning items,
retrieving and deleting stored responses, the API key, and bad input named by its field.

The server runs a tiny random model with a Hermes tool template: its texts are noise, so the
tests check structure, never meaning."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.live_server import Server, running_server
from tidal.gpu.random_model import build_model_dir
from tidal.templates import TEMPLATES_DIR

pytestmark = [pytest.mark.gpu, pytest.mark.integration]
KEY = "responses-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
WEATHER = {"type": "object",
           "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": WEATHER, "strict": True}]
FORCED = {"type": "function", "name": "get_weather"}
QUESTION = "What is the weather in Paris?"
CUT = {"max_output_tokens": 12, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
ANSWER = r"[a-z]{2,6}"  # what follows the thinking, where there is any


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = build_model_dir(tmp_path_factory.mktemp("responses") / "tiny", "llama",
                            max_position_embeddings=2048,
                            added_tokens=("<tool_call>", "</tool_call>", "<think>",
                                          "</think>"))
    with running_server(model, "--kv-cache-memory", "16MiB", "--api-key", KEY,
                        "--chat-template", str(TEMPLATES_DIR / "hermes_tools.jinja"),
                        "--reasoning-parser", "qwen3") as srv:
        yield Server(srv.url, srv.port, str(model))


@pytest.fixture(scope="module")
def biased(server: Server) -> dict[str, dict[str, float]]:
    """``logit_bias`` that makes a thinking block short where the random model opens one
    (``"</think>"``), and one that makes it open one too (``"<think>"``)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(server.model)
    opener, closer = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    return {"</think>": {str(closer): 8}, "<think>": {str(opener): 6, str(closer): 6}}


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def _post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=60)


# -- text ---------------------------------------------------------------------------------------
def test_plain_text_is_the_chat_reply(server: Server, client: openai.OpenAI) -> None:
    resp = client.responses.create(model=server.model, input=QUESTION, **CUT)
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    (message,) = resp.output
    assert message.type == "message" and message.role == "assistant"
    assert message.status == "incomplete" and message.content[0].type == "output_text"
    usage = resp.usage
    assert usage.output_tokens == 12
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    chat = _post(server, "/v1/chat/completions", {
        "model": server.model, "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}).json()
    assert resp.output_text == chat["choices"][0]["message"]["content"]
    assert usage.input_tokens == chat["usage"]["prompt_tokens"]


def test_streamed_events_add_up_to_the_whole_reply(server: Server,
                                                   client: openai.OpenAI) -> None:
    whole = client.responses.create(model=server.model, input=QUESTION, **CUT)
    events = list(client.responses.create(model=server.model, input=QUESTION, stream=True,
                                          **CUT))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    item_id = events[2].item.id
    assert {e.item_id for e in events[3:-2]} == {item_id} and events[-2].item.id == item_id
    assert {e.output_index for e in events[2:-1]} == {0}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text and text == events[-4].text == final.output_text == whole.output_text
    assert final.id == events[0].response.id and final.usage.output_tokens == 12


def test_the_stream_helper_and_json_schema_output(server: Server, client: openai.OpenAI,
                                                  biased: dict) -> None:
    bias = biased["</think>"]
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    with client.responses.stream(model=server.model, input=QUESTION, text={"format": fmt},
                                 max_output_tokens=120, temperature=1.0,
                                 extra_body={"seed": 5, "logit_bias": bias}) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.text.format.type == "json_schema"
    assert "".join(deltas) == final.output_text
    jsonschema.validate(json.loads(final.output_text), WEATHER)
    whole = client.responses.create(model=server.model, input=QUESTION, text={"format": fmt},
                                    max_output_tokens=120, temperature=1.0,
                                    extra_body={"seed": 5, "logit_bias": bias})
    assert whole.output_text == final.output_text  # the same seed, the same reply


def test_reasoning_items(server: Server, client: openai.OpenAI, biased: dict) -> None:
    ask = {"model": server.model, "input": QUESTION, "max_output_tokens": 40,
           "temperature": 1.0, "extra_body": {"seed": 7, "logit_bias": biased["<think>"],
                                              "structured_outputs": {"regex": ANSWER}}}
    resp = client.responses.create(**ask)
    reasoning, message = resp.output
    assert reasoning.type == "reasoning" and reasoning.content[0].type == "reasoning_text"
    thought = reasoning.content[0].text
    assert thought and resp.output_text.isalpha()  # the regex held the answer alone
    assert resp.usage.output_tokens_details.reasoning_tokens > 0
    with client.responses.stream(**ask) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert types.index("response.reasoning_text.done") < types.index(
        "response.output_text.delta")
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == thought and events[-1].response.output_text == resp.output_text


# -- tools --------------------------------------------------------------------------------------
def test_a_function_call_and_its_output_in_a_follow_up(server: Server, client: openai.OpenAI,
                                                       biased: dict) -> None:
    with client.responses.stream(model=server.model, input=QUESTION, tools=TOOLS,
                                 tool_choice=FORCED, max_output_tokens=200,
                                 extra_body={"seed": 1, "logit_bias": biased["</think>"]}
                                 ) as stream:
        events = list(stream)
        first = stream.get_final_response()
    call = first.output[-1]  # after the thinking, where the model thought
    assert [o.type for o in first.output[:-1]] in ([], ["reasoning"])
    mine = [e for e in events[2:] if call.id in (getattr(e, "item_id", None),
                                                 getattr(getattr(e, "item", None), "id", None))]
    assert [e.type for e in mine] + [events[-1].type] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert mine[1].delta == mine[2].arguments == call.arguments
    assert call.parsed_arguments == json.loads(call.arguments)  # the helper read the tool
    jsonschema.validate(call.parsed_arguments, WEATHER)
    assert client.responses.retrieve(first.id).output[-1].arguments == call.arguments
    answer = [{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}]
    follow = client.responses.create(model=server.model, previous_response_id=first.id,
                                     input=answer, tools=TOOLS, **CUT)
    alone = client.responses.create(model=server.model, input=answer, tools=TOOLS, **CUT)
    assert follow.previous_response_id == first.id and follow.status == "incomplete"
    # the follow-up's prompt holds the question and the call besides the call's output
    assert follow.usage.input_tokens >= alone.usage.input_tokens + first.usage.output_tokens


# -- stored responses ----------------------------------------------------------------------------
def test_get_and_delete(server: Server, client: openai.OpenAI) -> None:
    resp = client.responses.create(model=server.model, input="Hi", max_output_tokens=4)
    got = client.responses.retrieve(resp.id)
    assert (got.id, got.output_text, got.usage) == (resp.id, resp.output_text, resp.usage)
    deleted = httpx.delete(f"{server.url}/v1/responses/{resp.id}", headers=AUTH)
    assert deleted.json() == {"id": resp.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(resp.id)
    unstored = client.responses.create(model=server.model, input="Hi", max_output_tokens=4,
                                       store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    second = client.responses.create(model=server.model, input="Hi", max_output_tokens=4)
    client.responses.delete(second.id)  # the client's own delete
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=server.model, input="x", previous_response_id=second.id)
    assert info.value.param == "previous_response_id"


def test_the_api_key_is_required(server: Server) -> None:
    url = f"{server.url}/v1/responses"
    assert httpx.post(url, json={"input": "Hi"}).status_code == 401
    assert httpx.get(url + "/resp_x").status_code == 401
    assert httpx.delete(url + "/resp_x").status_code == 401


# -- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize("body,status,param", [
    ({"input": 5}, 400, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, 400, "input[0].role"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "w", "schema": "no"}}},
     400, "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "w",
                                        "schema": {"type": "nonsense"}}}},
     400, "text.format.schema"),
    ({"input": "x", "tools": [{"type": "function", "name": ""}]}, 400, "tools[0].name"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "f"}},
     400, "tool_choice"),
    ({"input": "x", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
])
def test_bad_input_names_its_field(server: Server, body: dict[str, Any], status: int,
                                   param: str) -> None:
    for stream in (False, True):  # refused before a stream opens
        resp = _post(server, "/v1/responses", {"model": server.model, "stream": stream, **body})
        assert resp.status_code == status, resp.text
        error = resp.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_bad_input_through_the_client(server: Server, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=server.model, input="x", max_output_tokens=10**6)
    assert info.value.param == "max_output_tokens"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")
