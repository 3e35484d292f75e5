"""Tool-call formats: parsing whole replies and streamed ones (the same content and calls for
every way of cutting a reply into deltas). Their grammars: test_tool_call_grammars.py; the
Hermes-style chat template: test_hermes_template.py."""

from __future__ import annotations

import json
import random
import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tidal.app.tool_parsers import (
    PARSERS,
    ParsedReply,
    ToolCall,
    ToolParser,
    get_parser,
)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                 "maxItems": 3},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "where": {"type": "object",
                  "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                  "required": ["lat", "lon"]},
    },
    "required": ["city", "unit", "where"],
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "maxLength": 16},
        "filters": {"type": "array", "maxItems": 2, "items": {
            "type": "object",
            "properties": {"field": {"enum": ["title", "body"]}, "exact": {"type": "boolean"}},
            "required": ["field", "exact"]}},
    },
    "required": ["query", "filters"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search", "parameters": SEARCH}},
    {"type": "function", "function": {"name": "ping"}},
]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH, "ping": {"type": "object"}}
NAMES = list(PARSERS)


def render_calls(parser: str, calls: list[tuple[str, str]]) -> str:
    """``calls`` (name, arguments text) as ``parser``'s model writes them."""
    if parser == "hermes":
        return "\n".join(f'<tool_call>\n{{"name": {json.dumps(n)}, "arguments": {a}}}\n'
                         "</tool_call>" for n, a in calls)
    if parser == "llama3_json":
        return "; ".join(f'{{"name": {json.dumps(n)}, "parameters": {a}}}' for n, a in calls)
    return "[TOOL_CALLS][" + ", ".join(
        f'{{"name": {json.dumps(n)}, "arguments": {a}}}' for n, a in calls) + "]"


def triggers(parser: str) -> list[str]:
    return [t.text for t in PARSERS[parser].syntax.triggers]


# -- streaming helpers -------------------------------------------------------------------------

def stream(parser: ToolParser, deltas: list[str], cut: bool = False
           ) -> tuple[str, list[dict], ParsedReply]:
    """Content, calls ({id, name, arguments}) and result of a reply fed as ``deltas``,
    checking the shape of every delta item on the way: each call arrives whole, in one."""
    streamer = parser.streamer()
    content, calls = "", []
    for delta in [*(streamer.feed(d) for d in deltas), streamer.finish(cut)]:
        content += delta.content
        for item in delta.tool_calls:
            assert set(item) == {"index", "id", "type", "function"}
            assert item["index"] == len(calls) and item["type"] == "function"
            assert re.fullmatch(r"call_[0-9a-f]{24}", item["id"])
            function = item["function"]
            assert function["name"] and function["arguments"].startswith("{")
            calls.append({"id": item["id"], **function})
    return content, calls, streamer.result()


def chunkings(text: str, seed: int) -> list[list[str]]:
    """Whole, character by character, and random cuts."""
    rng = random.Random(seed)
    cuts = [[text], list(text)]
    for _ in range(4):
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(1, 7)
            pieces.append(text[i:i + n])
            i += n
        cuts.append(pieces)
    return cuts


def assert_streams_like_extract(parser: ToolParser, text: str, seed: int = 0,
                                cut: bool = False) -> ParsedReply:
    expected = parser.extract(text, cut)
    for deltas in chunkings(text, seed):
        content, calls, result = stream(parser, deltas, cut)
        assert content == (expected.content or "")
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.name, c.arguments) for c in expected.tool_calls]
        assert [(c["id"], c["name"], c["arguments"]) for c in calls] == [
            (c.id, c.name, c.arguments) for c in result.tool_calls]
        assert result.content == expected.content
    return expected


# -- ToolCall ----------------------------------------------------------------------------------

def test_tool_call_openai_shape():
    call = ToolCall("call_0123456789abcdef01234567", "f", '{"a": 1}')
    assert call.to_openai() == {"id": "call_0123456789abcdef01234567", "type": "function",
                                "function": {"name": "f", "arguments": '{"a": 1}'}}


def test_ids_are_unique_call_ids():
    reply = get_parser("hermes").extract(render_calls("hermes", [("f", "{}")] * 3))
    ids = [c.id for c in reply.tool_calls]
    assert len(set(ids)) == 3 and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


# -- extract -----------------------------------------------------------------------------------

ARGS = '{"city": "Paris", "where": {"lat": 48.85, "lon": 2.35}, "tags": ["a", "}"]}'


@pytest.mark.parametrize("name", NAMES)
def test_extract_calls_and_content(name):
    text = "Let me look.\n\n" + render_calls(name, [("get_weather", ARGS), ("ping", "{}")])
    reply = get_parser(name).extract(text)
    assert reply.content == "Let me look."
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [
        ("get_weather", ARGS), ("ping", "{}")]


@pytest.mark.parametrize("name", NAMES)
def test_extract_without_calls_keeps_the_text(name):
    text = "  A plain answer: {\"name\" is a key} [TOOL] <tool> {\"name\": 1}\n"
    assert get_parser(name).extract(text) == ParsedReply(text, [])
    assert get_parser(name).extract("") == ParsedReply(None, [])  # no content at all


@pytest.mark.parametrize("name", NAMES)
def test_only_calls_give_no_content(name):
    reply = get_parser(name).extract("\n " + render_calls(name, [("ping", "{}")]) + " \n")
    assert reply.content is None and len(reply.tool_calls) == 1


def test_arguments_are_the_text_as_generated():
    args = '{ "b" :[1,2.5e-3, true,null] ,\n  "a": {"k": "\\u00e9\\"}"} }'
    for name in NAMES:
        reply = get_parser(name).extract(render_calls(name, [("f", f"  {args}\n")]))
        assert reply.tool_calls[0].arguments == args
        assert json.loads(reply.tool_calls[0].arguments)["a"]["k"] == 'é"}'


def test_hermes_variants():
    parser = get_parser("hermes")
    compact = parser.extract('<tool_call>{"name":"f","arguments":{"x":1}}</tool_call>')
    assert [(c.name, c.arguments) for c in compact.tool_calls] == [("f", '{"x":1}')]
    first_args = parser.extract('<tool_call>\n{"arguments": {"x": [1]}, "name": "g"}\n'
                                "</tool_call>")
    assert [(c.name, c.arguments) for c in first_args.tool_calls] == [("g", '{"x": [1]}')]
    unclosed = parser.extract('Sure <tool_call>\n{"name": "f", "arguments": {}}')
    assert unclosed.content == "Sure" and unclosed.tool_calls[0].name == "f"
    after = parser.extract('<tool_call>{"name": "f", "arguments": {}}</tool_call>\nDone.')
    assert after.content == "Done." and len(after.tool_calls) == 1


def test_llama_variants():
    parser = get_parser("llama3_json")
    tagged = parser.extract('<|python_tag|>{"name": "f", "parameters": {"q": "x"}}')
    assert [(c.name, c.arguments) for c in tagged.tool_calls] == [("f", '{"q": "x"}')]
    several = parser.extract('{"name": "f", "parameters": {}};{"name": "g", "parameters": '
                             '{"a": 1}}; ')
    assert several.content is None
    assert [(c.name, c.arguments) for c in several.tool_calls] == [("f", "{}"),
                                                                    ("g", '{"a": 1}')]
    answer = '{"name": "Ada", "age": 36}'
    assert parser.extract(answer) == ParsedReply(answer, [])


def test_mistral_variants():
    parser = get_parser("mistral")
    spaced = parser.extract('[TOOL_CALLS] [ {"name": "f", "arguments": {"a": 1}} ,'
                            '{"name": "g", "arguments": {}} ]')
    assert [(c.name, c.arguments) for c in spaced.tool_calls] == [("f", '{"a": 1}'),
                                                                   ("g", "{}")]
    assert parser.extract("[TOOL_CALLS][]") == ParsedReply("[TOOL_CALLS][]", [])


GARBAGE = {
    "hermes": ['<tool_call>\n{"name": "f", "arguments": {"a": tru}}\n</tool_call>',
               "<tool_call>not json</tool_call>", '<tool_call>{"name": "f"}</tool_call>',
               '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
               '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>',
               '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>'],
    "llama3_json": ['<|python_tag|>brave_search.call(query="x")',
                    '{"name": "f", "parameters": {"a": 01}}'],
    "mistral": ['[TOOL_CALLS][{"name": "f", "arguments": {"a": [1,}}]', "[TOOL_CALLS]{}",
                '[TOOL_CALLS][{"name": "f", "arguments": {"s": "\x01"}}]'],
}


NOT_A_CALL = {"hermes": "<tool_call>not json</tool_call>", "mistral": "[TOOL_CALLS]{}",
              "llama3_json": '<|python_tag|>brave_search.call(query="x")'}


@pytest.mark.parametrize("name", NAMES)
def test_malformed_calls_are_content(name):
    for text in GARBAGE[name]:
        reply = get_parser(name).extract("Hi. " + text)
        assert reply == ParsedReply("Hi. " + text, []), text
        stream(get_parser(name), list("Hi. " + text))  # never raises


def test_malformed_call_after_a_good_one():
    parser = get_parser("hermes")
    good = render_calls("hermes", [("f", "{}")])
    reply = parser.extract(good + "\n<tool_call>{oops}</tool_call>")
    assert reply.content == "<tool_call>{oops}</tool_call>"
    assert [c.name for c in reply.tool_calls] == ["f"]
    mistral = get_parser("mistral").extract('[TOOL_CALLS][{"name": "f", "arguments": {}}, 7]')
    assert [c.name for c in mistral.tool_calls] == ["f"] and mistral.content == ", 7]"


# -- streaming ---------------------------------------------------------------------------------

ARGUMENTS_FIRST = {
    "hermes": '<tool_call>\n{"arguments": {"x": "é😀"}, "name": "f"}\n</tool_call>',
    "llama3_json": '<|python_tag|>{"parameters": {"x": "é😀"}, "name": "f"}',
    "mistral": '[TOOL_CALLS][{"arguments": {"x": "é😀"}, "name": "f"}]',
}


@pytest.mark.parametrize("name", NAMES)
def test_streaming_matches_extract(name):
    texts = [
        "Checking the weather. " + render_calls(name, [("get_weather", ARGS),
                                                        ("search", '{"query": "x"}')]),
        render_calls(name, [("ping", "{ }")]) + "\n\nAnything else?",
        ARGUMENTS_FIRST[name],
        "No tools needed: <tool {name} [TOOL] {\"name\"} ; < [",
        "Hi. " + NOT_A_CALL[name],
    ]
    for seed, text in enumerate(texts):
        assert_streams_like_extract(get_parser(name), text, seed)
    reply = get_parser(name).extract(ARGUMENTS_FIRST[name])
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [("f", '{"x": "é😀"}')]


@pytest.mark.parametrize("name", NAMES)
def test_a_call_arrives_whole_once_its_object_closes(name):
    text = render_calls(name, [("get_weather", ARGS)])
    streamer = get_parser(name).streamer()
    deltas = [streamer.feed(ch).tool_calls for ch in text]
    (at,) = [i for i, items in enumerate(deltas) if items]
    (item,) = deltas[at]
    assert item["function"] == {"name": "get_weather", "arguments": ARGS}
    assert text[:at + 1].rstrip().endswith("}")  # the character that closed the object


def test_a_trigger_prefix_is_held_back():
    streamer = get_parser("hermes").streamer()
    assert streamer.feed("Let me check <tool_").content == "Let me check"
    assert streamer.feed("box> sure").content == " <tool_box> sure"
    streamer = get_parser("hermes").streamer()
    assert streamer.feed("Hello <tool_").content == "Hello"
    delta = streamer.feed('call>\n{"name": "f", "arguments": {"x"')
    assert delta.content == "" and delta.tool_calls == []
    assert streamer.finish().content == ""
    llama = get_parser("llama3_json").streamer()
    assert llama.feed("Set {").content == "Set"
    assert llama.feed("1, 2}").content == " {1, 2}"
    assert llama.finish().content == ""


def test_held_back_text_comes_out_at_the_end():
    """A reply that ends on the start of a trigger: text when it ended of itself, a call
    that never came (dropped) when ``max_tokens`` cut it."""
    for name, tail in [("hermes", " <tool_ca"), ("llama3_json", ' {"na'),
                       ("mistral", " [TOOL_")]:
        streamer = get_parser(name).streamer()
        assert streamer.feed("Text" + tail).content == "Text"
        assert streamer.finish().content == tail
        streamer = get_parser(name).streamer()
        assert streamer.feed("Text" + tail).content == "Text"
        assert streamer.finish(cut=True).content == ""
        assert get_parser(name).extract("Text" + tail, cut=True) == ParsedReply("Text", [])


@pytest.mark.parametrize("name", NAMES)
def test_a_cut_off_call_is_dropped(name):
    """A reply that ends inside a call (``max_tokens``, a stop string) or right after its
    trigger: the unfinished call is neither a call nor content, streamed or not, and the
    calls before it stay."""
    whole = render_calls(name, [("f", '{"city": "Paris"}'), ("g", '{"city": "Rome"}')])
    first = render_calls(name, [("f", '{"city": "Paris"}')])
    second_closes = whole.rindex("}") + 1
    for end in range(len(first) + 1, len(whole)):
        reply = assert_streams_like_extract(get_parser(name), "Sure. " + whole[:end], end,
                                            cut=True)
        names = ["f", "g"] if end >= second_closes else ["f"]
        assert reply.content == "Sure." and [c.name for c in reply.tool_calls] == names
    for end in range(1, first.rindex("}")):
        reply = assert_streams_like_extract(get_parser(name), "Sure. " + first[:end], end,
                                            cut=True)
        assert reply == ParsedReply("Sure.", []), first[:end]


def test_a_call_broken_after_its_start_is_content():
    """Only a model writing without the grammar breaks a call's syntax: from its trigger on,
    the text is content, streamed or not."""
    text = '<tool_call>\n{"name": "f", "arguments": {"a": tru}}\n</tool_call> ok'
    content, calls, result = stream(get_parser("hermes"), list(text))
    assert calls == [] and content == text == result.content
    assert get_parser("hermes").extract(text) == ParsedReply(text, [])


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                 max_size=3),
    max_leaves=8)
ARGUMENT_TEXT = st.builds(
    lambda value, indent, ascii_only: json.dumps(value, indent=indent, ensure_ascii=ascii_only),
    st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=4),
    st.sampled_from([None, 1, 2]), st.booleans())
CALLS = st.lists(st.tuples(st.sampled_from(["f", "get_weather", "a-b_c.d"]), ARGUMENT_TEXT),
                 max_size=3)
TEXT = st.text(alphabet=st.sampled_from(list("ab é😀 \n<>{}[]\":;,_tolcaTOL|")), max_size=20)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(NAMES), before=TEXT, calls=CALLS, after=TEXT,
       seed=st.integers(0, 1000))
def test_any_reply_streams_like_extract(name, before, calls, after, seed):
    text = before + render_calls(name, calls) + after if calls else before
    assume(not any(t in before + after for t in triggers(name)))
    expected = assert_streams_like_extract(get_parser(name), text, seed)
    assert [(c.name, c.arguments) for c in expected.tool_calls] == [
        (n, a.strip()) for n, a in calls]
    content = expected.content or ""
    assert not any(t in content for t in triggers(name))
    assert (calls and expected.content is None) or before.strip() in content
