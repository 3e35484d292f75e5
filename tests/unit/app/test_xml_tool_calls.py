"""Qwen3-Coder's XML calls: raw parameter values typed by their schemas, streamed as they are
read whole, and the parameter grammar (``xml_parameters.py``), which admits what the parser
reads back valid and nothing it would misread."""

from __future__ import annotations

import json
import random
import re
from dataclasses import replace

import jsonschema
import pytest
import xgrammar as xgr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.app.test_tool_call_grammars import walker  # noqa: F401
from tests.unit.app.test_tool_parsers import assert_streams_like_extract
from tidal.app.tool_parsers import ParsedReply, get_parser
from tidal.app.tool_parsers.xml_parameters import (
    CLOSE,
    TEXT,
    char_class,
    parameter_value,
    text_without,
)
from tidal.core.structured_output.compiler import structural_tag_json

NOTE = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 10},
    "body": {"type": "string"},
    "count": {"type": "integer", "minimum": 0, "maximum": 99},
    "ratio": {"type": "number"},
    "draft": {"type": "boolean"},
    "kind": {"enum": ["memo", "todo"]},
    "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    "owner": {"$ref": "#/$defs/person"},
    "extra": {"type": ["string", "null"], "maxLength": 5},
}, "required": ["title", "count", "kind"], "additionalProperties": False,
    "$defs": {"person": {"type": "object", "properties": {"name": {"enum": ["ann", "bo"]}},
                         "required": ["name"], "additionalProperties": False}}}
TOOLS = [{"type": "function", "function": {"name": "note", "parameters": NOTE}},
         {"type": "function", "function": {"name": "ping"}}]


def call(name: str, parameters: list[tuple[str, str]]) -> str:
    blocks = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in parameters)
    return f"<tool_call>\n<function={name}>\n{blocks}</function>\n</tool_call>"


# -- reading -----------------------------------------------------------------------------------

def test_values_are_typed_by_their_schemas():
    parser = get_parser("qwen3_coder", TOOLS)
    text = call("note", [("title", "12"), ("count", "7"), ("ratio", "-0.5e1"), ("draft", "true"),
                         ("kind", "null"), ("tags", '["a", "b"]'), ("owner", '{"name": "bo"}'),
                         ("extra", "null"), ("body", "line 1\n  <b>x</b> </param\n")])
    (got,) = parser.extract(text).tool_calls
    assert json.loads(got.arguments) == {
        "title": "12", "count": 7, "ratio": -5.0, "draft": True, "kind": "null",
        "tags": ["a", "b"], "owner": {"name": "bo"}, "extra": None,
        "body": "line 1\n  <b>x</b> </param\n"}


def test_values_without_a_schema_are_json_if_they_read_as_json():
    for schema in (None, {}, {"type": "integer"}, {"anyOf": [{"type": "string"}]}):
        assert parameter_value("12", schema) == 12
        assert parameter_value("a b", schema) == "a b"
        assert parameter_value("NaN", schema) == "NaN"  # not JSON, whatever Python reads
    reply = get_parser("qwen3_coder").extract(call("f", [("x", '{"a": 1}'), ("y", "hi")]))
    assert json.loads(reply.tool_calls[0].arguments) == {"x": {"a": 1}, "y": "hi"}


def test_only_one_newline_each_side_is_layout():
    parser = get_parser("qwen3_coder", TOOLS)
    for value in ["", "\n", "\n\nx\n\n", " x ", "x</parameter"]:
        (got,) = parser.extract(call("note", [("title", value)])).tool_calls
        assert json.loads(got.arguments) == {"title": value}
    compact = "<tool_call><function=note><parameter=title>x</parameter></function></tool_call>"
    assert json.loads(parser.extract(compact).tool_calls[0].arguments) == {"title": "x"}


def test_a_value_runs_to_the_first_closing_tag():
    text = call("note", [("title", "a</parameter>b")])
    assert get_parser("qwen3_coder", TOOLS).extract(text) == ParsedReply(text, [])


XML_VALUES = st.text(alphabet=st.sampled_from(list("ab <>/=\n\"{}[]:,é😀")), max_size=12)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(before=st.text(alphabet=st.sampled_from(list("ab <>\n_/lt")), max_size=10),
       values=st.lists(st.tuples(st.sampled_from(["title", "body", "p_1", "x"]), XML_VALUES),
                       max_size=3),
       calls=st.integers(1, 2), seed=st.integers(0, 1000))
def test_any_xml_reply_streams_like_extract(before, values, calls, seed):
    values = [(k, v) for k, v in values if CLOSE not in v]
    text = before + "\n".join(call("note", values) for _ in range(calls))
    reply = assert_streams_like_extract(get_parser("qwen3_coder", TOOLS), text, seed)
    if "<tool_call>" not in before:
        expected = {k: v if k in ("title", "body") else _as_json_if_it_is(v) for k, v in values}
        assert [json.loads(c.arguments) for c in reply.tool_calls] == [expected] * calls
        assert (reply.content or "") == before.rstrip()


def _as_json_if_it_is(value: str) -> object:
    """A parameter no schema types: its JSON where the text is JSON, else the text."""
    try:
        return json.loads(value)
    except ValueError:
        return value


# -- the grammar -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compiled(walker):  # noqa: F811
    compiler = walker[0]
    tag = get_parser("qwen3_coder").structural_tag(
        TOOLS, {"type": "function", "function": {"name": "note"}}, False)
    return compiler.compile_structural_tag(structural_tag_json(tag))


REQUIRED = [("title", "Hi"), ("count", "3"), ("kind", "todo")]


def test_grammar_takes_every_kind_of_value(compiled):
    text = call("note", [("title", "a\tb é😀"), ("body", "x\n<b>y</b>\n</para"),
                         ("count", "99"), ("ratio", "1.5"), ("draft", "false"),
                         ("kind", "memo"), ("code", "AB1"), ("tags", '["ab"]'),
                         ("owner", '{"name": "ann"}'), ("extra", '"x"')])
    assert xgr.GrammarMatcher(compiled).accept_string(text)
    reply = get_parser("qwen3_coder", TOOLS).extract(text)
    jsonschema.validate(json.loads(reply.tool_calls[0].arguments), NOTE)


@pytest.mark.parametrize("parameters", [
    REQUIRED[:2],  # a required parameter missing
    [("title", "Hi"), ("count", "three"), ("kind", "todo")],  # not an integer
    [("title", "Hi"), ("count", "100"), ("kind", "todo")],  # past its maximum
    [("title", "Hi"), ("count", "3"), ("kind", "note")],  # not in the enum
    [("title", "Hi<"), ("count", "3"), ("kind", "todo")],  # a bounded string holds no <
    [("title", "a\nb"), ("count", "3"), ("kind", "todo")],  # nor a newline
    [("title", "x" * 11), ("count", "3"), ("kind", "todo")],  # nor more than maxLength
    [*REQUIRED, ("code", "ab1")],  # off its pattern
    [*REQUIRED, ("owner", '{"name": "cy"}')],  # the $ref's enum
    [*REQUIRED, ("other", "1")],  # no such parameter
    [("count", "3"), ("title", "Hi"), ("kind", "todo")],  # out of the schema's order
])
def test_grammar_refuses_what_breaks_the_schema(compiled, parameters):
    assert not xgr.GrammarMatcher(compiled).accept_string(call("note", parameters))


def test_grammar_refuses_the_closing_tag_inside_a_value_and_loose_layout(compiled):
    for text in [call("note", [*REQUIRED, ("body", "a</parameter>b")]),
                 call("note", REQUIRED).replace("<parameter=title>\n", "<parameter=title>"),
                 call("note", REQUIRED).replace("3\n</parameter>", "3\n\n</parameter>")]:
        assert not xgr.GrammarMatcher(compiled).accept_string(text), text
    assert xgr.GrammarMatcher(compiled).accept_string(call("note", REQUIRED))


def test_a_schema_without_properties_takes_any_parameters(walker):  # noqa: F811
    compiler = walker[0]
    tag = get_parser("qwen3_coder").structural_tag(
        TOOLS, {"type": "function", "function": {"name": "ping"}}, False)
    compiled = compiler.compile_structural_tag(structural_tag_json(tag))
    assert xgr.GrammarMatcher(compiled).accept_string(call("ping", [("a_1", '{"b": [1]}')]))
    assert xgr.GrammarMatcher(compiled).accept_string(call("ping", []))
    assert not xgr.GrammarMatcher(compiled).accept_string(call("ping", [("a b", "1")]))


WRITE = {"type": "object", "properties": {"path": {"type": "string", "maxLength": 8},
                                          "content": {"type": "string"}},
         "required": ["path", "content"], "additionalProperties": False}
WRITE_TOOLS = [{"type": "function", "function": {"name": "write", "parameters": WRITE}}]


@pytest.mark.parametrize("schema,choice", [(NOTE, "required"), (NOTE, "auto")])
def test_walks_under_the_grammar_read_back_valid(walker, schema, choice):  # noqa: F811
    """Random replies, drawn toward the tags that close a value, parse and validate."""
    compiler, walker = walker
    markup = "\n</parameter>\n</function>\n</tool_call>"
    walker = replace(walker, closers=walker.closers | {
        i for i, piece in enumerate(walker.vocab) if piece and piece.decode(errors="replace")
        in markup})
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    parser = get_parser("qwen3_coder", tools)
    compiled = compiler.compile_structural_tag(structural_tag_json(
        parser.structural_tag(tools, choice, False)))
    rng = random.Random(choice)
    replies = [walker.walk(compiled, rng, "" if choice == "required" else "<tool_call>")
               for _ in range(16)]
    replies = [r for r in replies if r is not None]
    assert len(replies) >= 10
    for text in replies:
        reply = assert_streams_like_extract(parser, text)
        assert reply.tool_calls and (choice == "auto" or reply.content is None), text
        for got in reply.tool_calls:
            assert got.name == "f" and "\ufffd" not in got.arguments
            jsonschema.validate(json.loads(got.arguments), schema)


RAW = st.text(alphabet=st.sampled_from(list("</parmet>=\nxé\t")), max_size=30)


@settings(max_examples=300, deadline=None)
@given(RAW)
def test_raw_text_never_holds_the_closing_tag(text):
    pattern = text_without(CLOSE, TEXT)
    assert bool(re.fullmatch(pattern, text)) == (CLOSE not in text)


@pytest.fixture(scope="module")
def write_grammar(walker):  # noqa: F811
    tag = get_parser("qwen3_coder").structural_tag(WRITE_TOOLS, "required", False)
    return walker[0].compile_structural_tag(structural_tag_json(tag))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(content=RAW)
def test_an_unbounded_string_is_any_text_but_the_closing_tag(write_grammar, content):
    """Its grammar, as xgrammar compiles it: any lines, ``<`` and ``</`` included, up to
    the first ``</parameter>``; read back exactly."""
    text = call("write", [("path", "a.py"), ("content", content)])
    accepted = xgr.GrammarMatcher(write_grammar).accept_string(text)
    assert accepted == (CLOSE not in content)
    if accepted:
        reply = get_parser("qwen3_coder", WRITE_TOOLS).extract(text)
        assert json.loads(reply.tool_calls[0].arguments) == {"path": "a.py", "content": content}


def test_char_class_cuts_characters_out_of_ranges():
    assert char_class(((0x41, 0x45),), "AC") == "[\\u0042\\u0044-\\u0045]"
    assert char_class(TEXT, "<").count("-") == 4
