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

from tidal.app.harmony import CALL_ARGUMENTS, CALL_HEADER
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
XML = {"qwen3_coder"}  # arguments as parameter blocks, read back into a JSON object
JSON_NAMES = [n for n in NAMES if n not in XML]  # arguments as the model's own JSON text
DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def render_calls(parser: str, calls: list[tuple[str, str]]) -> str:
    """``calls`` (name, arguments text) as ``parser``'s model writes them."""
    if parser == "hermes":
        return "\n".join(f'<tool_call>\n{{"name": {json.dumps(n)}, "arguments": {a}}}\n'
                         "</tool_call>" for n, a in calls)
    if parser == "llama3_json":
        return "; ".join(f'{{"name": {json.dumps(n)}, "parameters": {a}}}' for n, a in calls)
    if parser == "mistral":
        return "[TOOL_CALLS][" + ", ".join(
            f'{{"name": {json.dumps(n)}, "arguments": {a}}}' for n, a in calls) + "]"
    if parser == "mistral_v11":
        return "".join(f"[TOOL_CALLS]{n}[ARGS]{a}" for n, a in calls)
    if parser == "qwen3_coder":
        return "\n".join(f"<tool_call>\n<function={n}>\n{qwen_parameters(a)}</function>\n"
                         "</tool_call>" for n, a in calls)
    if parser == "deepseek_v3":
        return DS_CALLS + "\n".join(f"{DS_CALL}function{DS_SEP}{n}\n```json\n{a}\n```"
                                    f"{DS_CALL_END}" for n, a in calls) + DS_CALLS_END
    if parser == "openai":  # as the gpt_oss reasoning splitter leaves Harmony's calls
        return "".join(f"{CALL_HEADER}{n}{CALL_ARGUMENTS}{a}" for n, a in calls)
    assert parser == "deepseek_v31", parser
    return DS_CALLS + "".join(f"{DS_CALL}{n}{DS_SEP}{a}{DS_CALL_END}"
                              for n, a in calls) + DS_CALLS_END


def qwen_parameters(arguments: str) -> str:
    """An arguments object as Qwen3-Coder's parameter blocks: a string raw, unless it would
    read as JSON (without a schema to say it is a string), any other value as JSON."""
    blocks = []
    for key, value in json.loads(arguments).items():
        raw = value if isinstance(value, str) and not reads_as_json(value) \
            else json.dumps(value, ensure_ascii=False)
        blocks.append(f"<parameter={key}>\n{raw}\n</parameter>\n")
    return "".join(blocks)


def reads_as_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def arguments_of(parser: str, text: str) -> object:
    """What a call's arguments say: for XML formats the object (its text is rebuilt), for
    the others the text as the model wrote it."""
    return json.loads(text) if parser in XML else text.strip()


def call_end(parser: str, text: str) -> int:
    """Where the last call in ``text`` is complete: after its arguments object, or the
    marker that ends a call of a format with one."""
    layout = PARSERS[parser].syntax.call
    end = getattr(layout, "end", "").split()
    return text.rindex(end[-1]) + len(end[-1]) if end else text.rindex("}") + 1


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
    assert [(c.name, arguments_of(name, c.arguments)) for c in reply.tool_calls] == [
        ("get_weather", arguments_of(name, ARGS)), ("ping", arguments_of(name, "{}"))]


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
    for name in JSON_NAMES:
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


def test_mistral_v11_variants():
    parser = get_parser("mistral_v11")
    spaced = parser.extract('[TOOL_CALLS] f [ARGS] {"a": 1}\n[TOOL_CALLS]g[ARGS]{}\nDone.')
    assert [(c.name, c.arguments) for c in spaced.tool_calls] == [("f", '{"a": 1}'),
                                                                   ("g", "{}")]
    assert spaced.content == "Done."
    listed = '[TOOL_CALLS][{"name": "f", "arguments": {}}]'  # the older form is not this one
    assert parser.extract(listed) == ParsedReply(listed, [])


def test_deepseek_variants():
    v3 = get_parser("deepseek_v3")
    compact = v3.extract(f'{DS_CALLS}{DS_CALL}function{DS_SEP}f ```json {{"a": 1}}```'
                         f"{DS_CALL_END}{DS_CALL}function{DS_SEP}g\n```json\n{{}}\n```"
                         f"{DS_CALL_END}{DS_CALLS_END}\nDone.")
    assert [(c.name, c.arguments) for c in compact.tool_calls] == [("f", '{"a": 1}'),
                                                                    ("g", "{}")]
    assert compact.content == "Done."
    v31 = render_calls("deepseek_v31", [("f", "{}")])
    assert get_parser("deepseek_v3").extract(v31) == ParsedReply(v31, [])
    v3_text = render_calls("deepseek_v3", [("f", "{}")])
    assert get_parser("deepseek_v31").extract(v3_text) == ParsedReply(v3_text, [])
    unclosed = get_parser("deepseek_v31").extract(f"Hi{DS_CALLS}{DS_CALL}f{DS_SEP}{{}}"
                                                 f"{DS_CALL_END} then")
    assert unclosed.content == "Hithen" and [c.name for c in unclosed.tool_calls] == ["f"]


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
    "mistral_v11": ['[TOOL_CALLS]f[ARGS]{"a": tru}', "[TOOL_CALLS]f {}",
                    "[TOOL_CALLS]f[ARGS][1]", "[TOOL_CALLS][ARGS]{}"],
    "qwen3_coder": ["<tool_call>\n<function=f>\n<parameter=a b>\n1\n</parameter>\n"
                    "</function>\n</tool_call>",
                    "<tool_call>\n<function=f>\nnot parameters\n</function>\n</tool_call>",
                    "<tool_call>\n<function f>\n</function>\n</tool_call>",
                    '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
                    "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</tool_call>"],
    "deepseek_v3": [f"{DS_CALLS}{DS_CALL}function{DS_SEP}f\n```json\n{{\"a\": tru}}\n```"
                    f"{DS_CALL_END}{DS_CALLS_END}",
                    f"{DS_CALLS}{DS_CALL}f{DS_SEP}{{}}{DS_CALL_END}{DS_CALLS_END}",
                    f"{DS_CALLS}{DS_CALL}function{DS_SEP}f\n```python\n{{}}\n```{DS_CALL_END}"],
    "deepseek_v31": [f"{DS_CALLS}{DS_CALL}f{DS_SEP}[]{DS_CALL_END}{DS_CALLS_END}",
                     f"{DS_CALLS}{DS_CALL}f{DS_SEP}{{}}{DS_CALLS_END}",
                     f"{DS_CALLS}function{DS_SEP}f{DS_CALL_END}{DS_CALLS_END}"],
    # Harmony's calls as the gpt_oss splitter leaves them (it drops malformed ones itself)
    "openai": [f"{CALL_HEADER}f{CALL_ARGUMENTS}[1]",
               f"{CALL_HEADER}f{CALL_ARGUMENTS}{{\"a\": tru}}",
               f"{CALL_HEADER}{CALL_ARGUMENTS}{{}}", f"{CALL_HEADER}f <|message|>{{}}"],
}


NOT_A_CALL = {"hermes": "<tool_call>not json</tool_call>", "mistral": "[TOOL_CALLS]{}",
              "llama3_json": '<|python_tag|>brave_search.call(query="x")',
              "mistral_v11": "[TOOL_CALLS]f {}", "qwen3_coder": GARBAGE["qwen3_coder"][1],
              "deepseek_v3": GARBAGE["deepseek_v3"][1],
              "deepseek_v31": GARBAGE["deepseek_v31"][2], "openai": GARBAGE["openai"][0]}


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
    # formats that name the function outside the arguments: a value past the ASCII range
    "mistral_v11": '[TOOL_CALLS]f[ARGS]{"x": "é😀"}',
    "qwen3_coder": "<tool_call>\n<function=f>\n<parameter=x>\né😀\n</parameter>\n</function>"
                   "\n</tool_call>",
    "deepseek_v3": render_calls("deepseek_v3", [("f", '{"x": "é😀"}')]),
    "deepseek_v31": render_calls("deepseek_v31", [("f", '{"x": "é😀"}')]),
    "openai": render_calls("openai", [("f", '{"x": "é😀"}')]),
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
def test_a_call_arrives_whole_once_it_is_complete(name):
    text = render_calls(name, [("get_weather", ARGS)])
    streamer = get_parser(name).streamer()
    deltas = [streamer.feed(ch).tool_calls for ch in text]
    (at,) = [i for i, items in enumerate(deltas) if items]
    (item,) = deltas[at]
    assert item["function"]["name"] == "get_weather"
    assert arguments_of(name, item["function"]["arguments"]) == arguments_of(name, ARGS)
    assert at + 1 == call_end(name, text)  # the character that completed the call


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
                       ("mistral", " [TOOL_"), ("mistral_v11", " [TOOL_"),
                       ("qwen3_coder", " <tool_ca"), ("hermes", " </tool_ca"),
                       ("qwen3_coder", " </param"), ("mistral_v11", " [AR"),
                       ("deepseek_v3", " <｜tool▁ca"), ("deepseek_v31", " <｜tool▁call▁e")]:
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
    second_closes = call_end(name, whole)
    for end in range(len(first) + 1, len(whole)):
        reply = assert_streams_like_extract(get_parser(name), "Sure. " + whole[:end], end,
                                            cut=True)
        names = ["f", "g"] if end >= second_closes else ["f"]
        assert reply.content == "Sure." and [c.name for c in reply.tool_calls] == names
    for end in range(1, call_end(name, first) - 1):
        reply = assert_streams_like_extract(get_parser(name), "Sure. " + first[:end], end,
                                            cut=True)
        assert reply == ParsedReply("Sure.", []), first[:end]


def test_a_reply_cut_inside_a_character_of_a_marker():
    """The detokenizer ends a reply cut inside a character's UTF-8 bytes with U+FFFD: where
    that character would continue a marker (``｜`` in ``<｜tool▁sep｜>``), it is the marker's
    start, cut short, not text."""
    first = render_calls("deepseek_v31", [("f", "{}")]).removesuffix(DS_CALLS_END)
    for name, text in [("deepseek_v31", f"Sure. {first}{DS_CALL}f<\ufffd"),
                       ("deepseek_v3", f"Sure. {DS_CALLS}<\ufffd"),
                       ("deepseek_v3", "Sure. <\ufffd")]:
        reply = assert_streams_like_extract(get_parser(name), text, cut=True)
        assert reply.content == "Sure." and len(reply.tool_calls) == text.count(DS_CALL_END)
    for text in ["Sure. <\ufffd", "Sure. <\ufffd and on"]:  # not cut: text after all
        assert get_parser("deepseek_v3").extract(text).content == text
    assert get_parser("hermes").extract("Sure. <\ufffd", cut=True).content == "Sure. <\ufffd"


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
@given(name=st.sampled_from(JSON_NAMES), before=TEXT, calls=CALLS, after=TEXT,
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
