"""gpt-oss's tool calls (the ``openai`` parser) read out of Harmony replies, whole and
streamed, with the ``gpt_oss`` reasoning split; the grammars for each ``tool_choice`` on the
model's own Harmony text; our template's calls read back (the round trip)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import xgrammar as xgr

from tests.unit.app.test_harmony import NEXT, REAL_TEMPLATE_LINE, TEMPLATE, A
from tests.unit.app.test_tool_call_grammars import walker  # noqa: F401  (a fixture)
from tests.unit.app.test_tool_parsers import SCHEMAS, TOOLS, chunkings
from tidal.app.chat_reply import ReplyDeltas, whole_message
from tidal.app.chat_template import ChatTemplate
from tidal.app.reasoning import FORMATS
from tidal.app.structured import ToolUse, after_thinking
from tidal.app.tool_parsers import default_parser, get_parser
from tidal.core.structured_output import StructuredOutputsParams
from tidal.core.structured_output.compiler import structural_tag_json
from tidal.templates import TEMPLATES_DIR

GPT_OSS = FORMATS["gpt_oss"]
CALL = "<|channel|>commentary to=functions.{} <|constrain|>json<|message|>{}"
ROLE_CALL = " to=functions.{}<|channel|>commentary json<|message|>{}"  # recipient in the role


def reply(reasoning, text: str, pieces: list[str] | None = None, cut: bool = False,
          tools=TOOLS) -> dict:
    """The chat message of ``text`` (streamed as ``pieces`` where given, deltas merged)."""
    tool_use = ToolUse(tools, get_parser("openai", tools)) if tools else None
    reason = "length" if cut else "stop"
    if pieces is None:
        return whole_message(tool_use, reasoning, text, reason)[0]
    deltas = ReplyDeltas(tool_use, reasoning)
    message: dict = {"role": "assistant", "content": None}
    for i, piece in enumerate(pieces):
        delta, _ = deltas.feed(piece, reason if i == len(pieces) - 1 else None)
        for key in ("reasoning_content", "content"):
            if key in delta:
                message[key] = (message.get(key) or "") + delta[key]
        for call in delta.get("tool_calls", []):
            message.setdefault("tool_calls", []).append(call)
    if reasoning is not None:
        message.setdefault("reasoning_content", None)
    return message


def calls_of(message: dict) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls", [])]


def same_either_way(reasoning, text: str, cut: bool = False, tools=TOOLS) -> dict:
    whole = reply(reasoning, text, cut=cut, tools=tools)
    for pieces in chunkings(text, len(text)):
        streamed = reply(reasoning, text, pieces, cut, tools)
        assert (streamed.get("reasoning_content"), streamed["content"] or None,
                calls_of(streamed)) == (whole.get("reasoning_content"),
                                        whole["content"] or None, calls_of(whole))
    return whole


WEATHER = '{"city": "Paris", "unit": "celsius", "where": {"lat": 48.9, "lon": 2.3}}'
QUERY = '{"query": "x"}'


@pytest.mark.parametrize("text,reasoning,content,calls", [
    (f"{A}Need weather.<|end|>{NEXT}{CALL.format('get_weather', WEATHER)}<|call|>",
     "Need weather.", None, [("get_weather", WEATHER)]),
    (f"{A}Need weather.<|end|>{NEXT}{ROLE_CALL.format('get_weather', WEATHER)}",
     "Need weather.", None, [("get_weather", WEATHER)]),
    (CALL.format("ping", "{}"), None, None, [("ping", "{}")]),  # no thinking, no <|call|>
    # parallel calls, the second with its recipient in the role part
    (f"{A}Two.<|end|>{NEXT}{CALL.format('ping', '{}')}<|call|>{NEXT}"
     f"{ROLE_CALL.format('search', QUERY)}<|call|>", "Two.", None,
     [("ping", "{}"), ("search", '{"query": "x"}')]),
    # an answer, then a call
    (f"{A}t<|end|>{NEXT}<|channel|>final<|message|>Checking.<|end|>{NEXT}"
     f"{CALL.format('ping', '{}')}", "t", "Checking.", [("ping", "{}")]),
    # malformed arguments: dropped, not content
    (f"{A}t<|end|>{NEXT}{CALL.format('ping', '{oops')}<|call|>", "t", None, []),
    (f"{A}t<|end|>{NEXT}{CALL.format('ping', '[1]')}<|call|>", "t", None, []),
])
def test_calls_and_reasoning(text, reasoning, content, calls):
    message = same_either_way(GPT_OSS, text)
    assert message.get("reasoning_content") == reasoning
    assert message["content"] == content and calls_of(message) == calls
    assert "<|" not in (message["content"] or "")


def test_a_call_cut_short_is_dropped():
    first = f"{A}t<|end|>{NEXT}{CALL.format('ping', '{}')}<|call|>{NEXT}"
    whole = first + CALL.format("get_weather", WEATHER)
    for end in range(len(first) - len(NEXT), len(whole)):
        message = same_either_way(GPT_OSS, whole[:end], cut=True)
        assert calls_of(message) == [("ping", "{}")], whole[:end]
        assert message["content"] is None and message["reasoning_content"] == "t"
    for end in range(len(A) + 1, len(first) - len(f"}}<|call|>{NEXT}")):
        message = same_either_way(GPT_OSS, first[:end], cut=True)
        assert calls_of(message) == [] and not message["content"], first[:end]


def test_without_a_reasoning_parser_the_calls_are_still_read():
    text = f"{A}secret<|end|>{NEXT}{CALL.format('ping', '{}')}"
    message = same_either_way(None, text)
    assert "reasoning_content" not in message and calls_of(message) == [("ping", "{}")]
    # without tools, a call is dropped (no markup in content)
    assert same_either_way(GPT_OSS, text, tools=None)["content"] == ""


def test_the_templates_select_the_openai_parser():
    assert default_parser(TEMPLATE.read_text()) == "openai"
    assert default_parser("{{- '<|start|>assistant<|channel|>' }}" + REAL_TEMPLATE_LINE) == (
        "openai")
    assert default_parser((TEMPLATES_DIR / "hermes_tools.jinja").read_text()) == "hermes"


# -- grammars ----------------------------------------------------------------------------------

VOCAB = [chr(i) for i in range(32, 127)] + ["\n", "é", "<|return|>", "<|call|>"]
STOPS = [len(VOCAB) - 2, len(VOCAB) - 1]


def grammar(choice, parallel: bool = True, reasoning=GPT_OSS) -> xgr.CompiledGrammar:
    tag = get_parser("openai", TOOLS).structural_tag(TOOLS, choice, parallel)
    spec = after_thinking(StructuredOutputsParams(structural_tag=tag, field="tools"),
                          reasoning)
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=STOPS)
    return xgr.GrammarCompiler(info).compile_structural_tag(
        structural_tag_json(spec.structural_tag))


def accepts(compiled: xgr.CompiledGrammar, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.accept_token(STOPS[1])


THINK = f"{A}free {{text<|end|>{NEXT}"
W = CALL.format("get_weather", WEATHER)
P = CALL.format("ping", "{}")
FINAL = "<|channel|>final<|message|>It is sunny."
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("choice,parallel,good,bad", [
    ("auto", True, [THINK + W, W, THINK + FINAL, FINAL, f"{W}<|call|>{NEXT}{P}"],
     ["It is sunny.", THINK + "It is sunny.", f"{FINAL}<|end|>", f"{FINAL}{NEXT}",
      f"{A}a<|channel|>b<|end|>{NEXT}{W}", f"{A}a<|end|>b<|end|>{NEXT}{W}",
      CALL.format("get_weather", '{"city": 1}'), CALL.format("nope", "{}")]),
    ("auto", False, [THINK + W], [f"{W}<|call|>{NEXT}{P}"]),
    ("required", True, [THINK + W, f"{THINK}{W}<|call|>{NEXT}{P}"], [THINK + FINAL, FINAL]),
    (NAMED, True, [THINK + W, W], [THINK + P, f"{W}<|call|>{NEXT}{W}", FINAL]),
])
def test_the_grammar_holds_harmony_replies(choice, parallel, good, bad):
    compiled = grammar(choice, parallel)
    for text in good:
        assert accepts(compiled, text), text
    for text in bad:
        assert not accepts(compiled, text), text


def test_a_schema_is_the_final_messages_body():
    spec = after_thinking(StructuredOutputsParams(json={"type": "object"},
                                                  field="response_format"), GPT_OSS)
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=STOPS)
    compiled = xgr.GrammarCompiler(info).compile_structural_tag(
        structural_tag_json(spec.structural_tag))
    final = '<|channel|>final<|message|>{"a": 1}'
    assert accepts(compiled, THINK + final) and accepts(compiled, final)
    assert not accepts(compiled, THINK + '{"a": 1}') and not accepts(compiled, '{"a": 1}')


@pytest.mark.parametrize("choice,parallel", [("auto", True), ("required", True),
                                             ("required", False), (NAMED, True)])
def test_replies_walked_under_the_grammar_parse_and_validate(walker, choice, parallel):  # noqa: F811
    """Random replies the grammar allows (the tiny tokenizer spells Harmony's tokens out)
    always split into valid calls, streamed as whole."""
    compiler, walk = walker
    tag = get_parser("openai", TOOLS).structural_tag(TOOLS, choice, parallel)
    compiled = compiler.compile_structural_tag(structural_tag_json(tag))
    rng = random.Random(f"{choice}{parallel}")
    again = f"<|call|>{NEXT}" if parallel and choice != NAMED else ""
    texts = [walk.walk(compiled, rng, "<|channel|>commentary" if choice == "auto" else "",
                       again) for _ in range(12)]
    texts = [t for t in texts if t is not None]
    assert len(texts) >= 8
    for text in texts:
        message = same_either_way(None, text)
        assert message["tool_calls"] and not message["content"], text
        assert len(message["tool_calls"]) == 1 or parallel and choice != NAMED
        for name, arguments in calls_of(message):
            assert name in SCHEMAS and (choice != NAMED or name == "get_weather")
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


# -- the template's round trip -----------------------------------------------------------------

def test_the_templates_turns_read_back():
    """An assistant turn as our template writes it, read back by the splitter and the parser:
    the same thinking, answer and calls."""
    class Tokenizer:
        chat_template = None

    template = ChatTemplate.for_tokenizer(Tokenizer(), str(TEMPLATE))
    calls = [{"id": "c1", "type": "function",
              "function": {"name": "get_weather", "arguments": WEATHER}},
             {"id": "c2", "type": "function", "function": {"name": "ping", "arguments": {}}}]
    turn = {"role": "assistant", "content": "Let me check.", "reasoning_content": "Hmm.",
            "tool_calls": calls}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                turn, {"role": "tool", "tool_call_id": "c2", "content": "pong"}]
    text = template.render(messages, False, tools=TOOLS)
    assert text.count("<|start|>developer<|message|># Instructions\n\nBe brief.") == 1
    assert "type get_weather = (_: {" in text and "namespace functions {" in text
    assert text.endswith("<|start|>functions.ping to=assistant<|channel|>commentary"
                         "<|message|>pong<|end|>")
    written = text.split("<|start|>user<|message|>Hi<|end|>")[1].split("<|start|>functions")[0]
    message = same_either_way(GPT_OSS, written.removeprefix(NEXT))
    assert message["reasoning_content"] == "Hmm." and message["content"] == "Let me check."
    assert calls_of(message) == [("get_weather", WEATHER), ("ping", "{}")]
    # an earlier turn's thinking is left out, as gpt-oss's template leaves it
    later = template.render([*messages, {"role": "user", "content": "More"}], True)
    assert "Hmm." not in later and later.endswith("<|start|>assistant")
