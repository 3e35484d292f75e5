"""templates/hermes_tools.jinja: the tools in the system turn, calls and tool results in the
conversation, and its calls read back by the Hermes parser."""

from __future__ import annotations

import json
import re

import pytest

from tests.unit.app.test_tool_parsers import TOOLS
from tidal.app.chat_template import _environment
from tidal.app.tool_parsers import (
    get_parser,
)
from tidal.templates import TEMPLATES_DIR

# -- the Hermes-style chat template ------------------------------------------------------------

@pytest.fixture(scope="module")
def hermes_template():
    return _environment().from_string((TEMPLATES_DIR / "hermes_tools.jinja").read_text())


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "21C"},
    {"role": "assistant", "content": "Paris 18C, Rome 21C."},
    {"role": "user", "content": "Thanks"},
]


def test_template_lists_tools_and_renders_calls_and_results(hermes_template):
    prompt = hermes_template.render(messages=CONVERSATION, tools=TOOLS,
                                    add_generation_prompt=True)
    system, rest = prompt.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    listed = re.search(r"<tools>\n(.*)\n</tools>", system, re.S).group(1).split("\n")
    assert [json.loads(line) for line in listed] == TOOLS
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n' \
           "</tool_call>" in system
    assert rest == (
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n"
        "<tool_response>\n21C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nParis 18C, Rome 21C.<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_template_calls_read_back_by_the_parser(hermes_template):
    prompt = hermes_template.render(messages=CONVERSATION[:3], tools=TOOLS)
    turn = prompt.split("<|im_start|>assistant\n")[1].removesuffix("<|im_end|>\n")
    reply = get_parser("hermes").extract(turn)
    assert reply.content is None
    assert [json.loads(c.arguments) for c in reply.tool_calls] == [{"city": "Paris"},
                                                                   {"city": "Rome"}]


def test_template_without_tools_is_plain_chatml(hermes_template):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                {"role": "assistant", "content": "A"}]
    assert hermes_template.render(messages=messages, add_generation_prompt=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
        "<|im_start|>assistant\nA<|im_end|>\n")
    prompt = hermes_template.render(messages=messages[1:2], tools=TOOLS,
                                    add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n# Tools\n")
    assert prompt.endswith("<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n")


def test_template_content_with_text_parts(hermes_template):
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "Sure.",
                 "tool_calls": [{"function": {"name": "ping", "arguments": {}}}]}]
    assert hermes_template.render(messages=messages) == (
        "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\nSure.\n"
        '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call><|im_end|>\n')
