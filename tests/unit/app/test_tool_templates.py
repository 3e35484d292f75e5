"""The chat templates of the Qwen3-Coder, Mistral v11 and DeepSeek V3 / V3.1 formats: the
tools in the prompt, earlier calls and tool results in the conversation, those calls read
back by the format's parser, and the format and thinking the server takes from each. The
Hermes template: test_hermes_template.py."""

from __future__ import annotations

import json

import pytest

from tests.unit.app.test_tool_parsers import TOOLS
from tidal.app.chat_template import ChatTemplate, ChatTemplateError, _environment
from tidal.app.conversation import call_for_template
from tidal.app.metrics import ServerMetrics
from tidal.app.prepare import prepare_chat_request
from tidal.app.reasoning import default_format
from tidal.app.server_state import ServerSettings, ServerState
from tidal.app.tool_parsers import default_parser, get_parser
from tidal.gpu.random_model import build_tokenizer
from tidal.templates import TEMPLATES_DIR

TEMPLATES = {"qwen3_coder": "qwen3_coder_tools.jinja", "mistral_v11": "mistral_v11_tools.jinja",
             "deepseek_v3": "deepseek_v3_tools.jinja", "deepseek_v31": "deepseek_v31_tools.jinja"}
# where an assistant turn's text starts and ends in each format's prompt
TURNS = {"qwen3_coder": ("<|im_start|>assistant", "<|im_end|>"),
         "mistral_v11": ("[/INST]", "</s>"),
         "deepseek_v3": ("<｜Assistant｜>", "<｜end▁of▁sentence｜>"),
         "deepseek_v31": ("<｜Assistant｜></think>", "<｜end▁of▁sentence｜>")}
CALLS = [{"id": "call_1", "type": "function",
          "function": {"name": "get_weather",
                       "arguments": '{"city": "Paris", "days": 3, "where": {"lat": 1.5}}'}},
         {"id": "call_2", "type": "function",
          "function": {"name": "search", "arguments": {"query": "a <b>\nc", "filters": []}}}]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "none"},
    {"role": "assistant", "content": "Paris 18C."},
    {"role": "user", "content": "Thanks"},
]
# the conversation after its system prompt and tools, as each format writes it
REST = {
    "qwen3_coder": (
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=where>\n{\"lat\": 1.5}\n</parameter>\n"
        "</function>\n</tool_call>\n"
        "<tool_call>\n<function=search>\n<parameter=query>\na <b>\nc\n</parameter>\n"
        "<parameter=filters>\n[]\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n"
        "<tool_response>\nnone\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nParis 18C.<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n"),
    "mistral_v11": (
        "[INST]Weather in Paris?[/INST]"
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3, "where": {"lat": 1.5}}'
        '[TOOL_CALLS]search[ARGS]{"query": "a <b>\\nc", "filters": []}</s>'
        "[TOOL_RESULTS]18C[/TOOL_RESULTS][TOOL_RESULTS]none[/TOOL_RESULTS]Paris 18C.</s>"
        "[AVAILABLE_TOOLS]{tools}[/AVAILABLE_TOOLS][INST]Thanks[/INST]"),
    "deepseek_v3": (
        "<｜User｜>Weather in Paris?<｜Assistant｜><｜tool▁calls▁begin｜>"
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Paris", "days": 3, "where": {"lat": 1.5}}\n```<｜tool▁call▁end｜>\n'
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n"
        '{"query": "a <b>\\nc", "filters": []}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
        "<｜end▁of▁sentence｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>18C"
        "<｜tool▁output▁end｜>\n<｜tool▁output▁begin｜>none<｜tool▁output▁end｜>"
        "<｜tool▁outputs▁end｜>Paris 18C.<｜end▁of▁sentence｜><｜User｜>Thanks<｜Assistant｜>"),
    "deepseek_v31": (
        "<｜User｜>Weather in Paris?<｜Assistant｜></think><｜tool▁calls▁begin｜>"
        "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Paris", "days": 3, "where": {"lat": 1.5}}<｜tool▁call▁end｜>'
        '<｜tool▁call▁begin｜>search<｜tool▁sep｜>{"query": "a <b>\\nc", "filters": []}'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
        "<｜tool▁output▁begin｜>18C<｜tool▁output▁end｜><｜tool▁output▁begin｜>none"
        "<｜tool▁output▁end｜>Paris 18C.<｜end▁of▁sentence｜><｜User｜>Thanks"
        "<｜Assistant｜></think>"),
}
SYSTEM_END = {"qwen3_coder": "</tool_call><|im_end|>\n", "mistral_v11": "[/SYSTEM_PROMPT]",
              "deepseek_v3": "on its own line", "deepseek_v31": "separators or spaces"}


def as_server_sends(messages: list[dict]) -> list[dict]:
    """The messages as the server hands them to a template: calls' arguments as objects."""
    return [{**m, "tool_calls": [call_for_template(c) for c in m["tool_calls"]]}
            if m.get("tool_calls") else m for m in messages]


def render(name: str, messages: list[dict], tools: list[dict] | None = TOOLS,
           add_generation_prompt: bool = True) -> str:
    template = _environment().from_string((TEMPLATES_DIR / TEMPLATES[name]).read_text())
    return template.render(messages=as_server_sends(messages), tools=tools, bos_token="<s>",
                           eos_token="</s>", add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("name", TEMPLATES)
def test_template_renders_calls_and_results(name):
    prompt = render(name, CONVERSATION)
    head, rest = prompt.split(SYSTEM_END[name], 1)
    tools = json.dumps(TOOLS, ensure_ascii=False)
    if name == "mistral_v11":  # the tools come before the last user turn
        head, rest = head + SYSTEM_END[name], rest.replace(tools, "{tools}")
    assert rest == REST[name]
    assert head.startswith(("<s>Be brief.", "<s>[SYSTEM_PROMPT]Be brief.",
                            "<|im_start|>system\nBe brief."))


@pytest.mark.parametrize("name", TEMPLATES)
def test_template_lists_every_tool_with_its_parameters(name):
    prompt = render(name, CONVERSATION[1:2])
    for tool in TOOLS:
        function = tool["function"]
        assert function["name"] in prompt
        for key in (function.get("parameters") or {}).get("properties", {}):
            assert key in prompt
    if name == "qwen3_coder":
        assert "<name>city</name>\n<type>string</type>\n<maxLength>12</maxLength>" in prompt
        assert '<required>["city", "unit", "where"]</required>' in prompt
    else:
        assert json.dumps(TOOLS[0]["function"]["parameters"], ensure_ascii=False) in prompt


@pytest.mark.parametrize("name", TEMPLATES)
def test_template_calls_read_back_by_the_parser(name):
    start, end = TURNS[name]
    prompt = render(name, CONVERSATION[:3], add_generation_prompt=False)
    turn = prompt.split(start)[-1].split(end)[0]
    reply = get_parser(name, TOOLS).extract(turn)
    assert reply.content is None
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 3, "where": {"lat": 1.5}}),
        ("search", {"query": "a <b>\nc", "filters": []})]


@pytest.mark.parametrize("name", TEMPLATES)
def test_template_without_tools_has_no_tool_prompt(name):
    prompt = render(name, CONVERSATION[1:2], tools=None)
    assert "get_weather" not in prompt and "Tools" not in prompt and "TOOLS" not in prompt
    assert "Weather in Paris?" in prompt


@pytest.mark.parametrize("name", TEMPLATES)
def test_the_server_takes_the_format_and_no_thinking_from_the_template(name):
    text = (TEMPLATES_DIR / TEMPLATES[name]).read_text()
    assert default_parser(text) == name
    assert default_format(text) is None


def test_qwen_template_wants_arguments_as_an_object():
    call = {"function": {"name": "f", "arguments": "not json"}}
    messages = [{"role": "assistant", "content": None, "tool_calls": [call]}]
    template = ChatTemplate.for_tokenizer(None, TEMPLATES_DIR / TEMPLATES["qwen3_coder"])
    with pytest.raises(ChatTemplateError, match="object"):
        template.render(as_server_sends(messages))


def test_calls_reach_templates_with_their_arguments_as_objects():
    text_args = {"function": {"name": "f", "arguments": '{"a": [1]}'}, "id": "x"}
    assert call_for_template(text_args) == {"function": {"name": "f", "arguments": {"a": [1]}},
                                            "id": "x"}
    assert text_args["function"]["arguments"] == '{"a": [1]}'  # a copy, the request's intact
    for kept in ({"function": {"name": "f", "arguments": "[1]"}},
                 {"function": {"name": "f", "arguments": "{oops"}},
                 {"function": {"name": "f", "arguments": {"a": 1}}}, {"name": "f"}, "junk"):
        assert call_for_template(kept) == kept


@pytest.mark.parametrize("name", TEMPLATES)
def test_a_chat_request_through_the_template(name):
    """A server on one of these templates: the conversation's calls in its prompt, the reply
    read by the template's format, special-token markers kept in the reply's text."""
    tokenizer = build_tokenizer(512)
    path = str(TEMPLATES_DIR / TEMPLATES[name])
    state = ServerState(engine=None, tokenizer=tokenizer,
                        settings=ServerSettings(served_model_name="m", chat_template=path),
                        metrics=ServerMetrics(), chat_template=ChatTemplate.for_tokenizer(
                            tokenizer, path),
                        max_model_len=8192, vocab_size=len(tokenizer), kv_capacity_tokens=8192,
                        max_num_seqs=8)
    prep = prepare_chat_request({"model": "m", "messages": CONVERSATION, "tools": TOOLS,
                                 "max_tokens": 16}, state)
    assert REST[name].split("{tools}")[0].replace("</s>", tokenizer.eos_token) in prep.prompt
    assert prep.tool_use.parser.name == name and prep.reasoning is None
    assert prep.params.skip_special_tokens is (name == "qwen3_coder")
    assert prep.params.structured_outputs.structural_tag is not None
