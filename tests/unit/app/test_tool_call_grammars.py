"""The tool-call formats' grammars: the structural tags each parser writes for every
``tool_choice``, and replies walked at random under them, which always parse and validate."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import jsonschema
import numpy as np
import pytest
import xgrammar as xgr

from tests.unit.app.test_tool_parsers import (
    NAMES,
    SCHEMAS,
    TOOLS,
    assert_streams_like_extract,
    render_calls,
)
from tidal.app.tool_parsers import (
    HermesToolParser,
    ToolParser,
    default_parser,
    get_parser,
)
from tidal.core.structured_output.compiler import structural_tag_json
from tidal.gpu.random_model import build_tokenizer
from tidal.templates import TEMPLATES_DIR

# -- structural tags ---------------------------------------------------------------------------

def test_structural_tag_shapes():
    hermes = get_parser("hermes")
    auto = hermes.structural_tag(TOOLS, "auto", True)
    assert auto["type"] == "structural_tag"
    fmt = auto["format"]
    assert fmt["type"] == "triggered_tags" and fmt["triggers"] == ["<tool_call>"]
    assert not fmt["stop_after_first"] and not fmt["at_least_one"]
    assert [t["begin"] for t in fmt["tags"]] == [
        f'<tool_call>\n{{"name": "{n}", "arguments": ' for n in SCHEMAS]
    assert {t["end"] for t in fmt["tags"]} == {"}\n</tool_call>"}
    assert [t["content"]["json_schema"] for t in fmt["tags"]] == list(SCHEMAS.values())
    assert hermes.structural_tag(TOOLS, "auto", False)["format"]["stop_after_first"]
    required = hermes.structural_tag(TOOLS, "required", True)["format"]
    assert required["type"] == "tags_with_separator" and required["at_least_one"]
    named = hermes.structural_tag(TOOLS, {"type": "function", "function": {"name": "search"}},
                                  False)["format"]
    assert [t["begin"] for t in named["tags"]] == [
        '<tool_call>\n{"name": "search", "arguments": ']
    assert named["stop_after_first"]
    named_parallel = hermes.structural_tag(
        TOOLS, {"type": "function", "function": {"name": "search"}}, True)["format"]
    assert named_parallel["stop_after_first"]  # a named function: exactly one call


def test_structural_tag_mistral_and_llama():
    mistral = get_parser("mistral").structural_tag(TOOLS, "auto", True)["format"]
    assert mistral["triggers"] == ["[TOOL_CALLS]"] and mistral["stop_after_first"]
    (block,) = mistral["tags"]
    assert (block["begin"], block["end"]) == ("[TOOL_CALLS][", "]")
    assert block["content"]["separator"] == ", "
    llama = get_parser("llama3_json").structural_tag(TOOLS, "required", True)["format"]
    assert llama["separator"] == "; "
    assert llama["tags"][0]["begin"] == '{"name": "get_weather", "parameters": '


def test_structural_tag_mistral_v11_and_deepseek():
    v11 = get_parser("mistral_v11").structural_tag(TOOLS, "auto", True)["format"]
    assert v11["triggers"] == ["[TOOL_CALLS]"] and not v11["stop_after_first"]
    assert [t["begin"] for t in v11["tags"]] == [f"[TOOL_CALLS]{n}[ARGS]" for n in SCHEMAS]
    assert v11["excludes"] == ["[ARGS]"]
    for name, separator in [("deepseek_v3", "\n"), ("deepseek_v31", "")]:
        auto = get_parser(name).structural_tag(TOOLS, "auto", True)["format"]
        assert auto["triggers"] == ["<｜tool▁calls▁begin｜>"] and auto["stop_after_first"]
        (block,) = auto["tags"]
        assert (block["begin"], block["end"]) == ("<｜tool▁calls▁begin｜>",
                                                  "<｜tool▁calls▁end｜>")
        assert block["content"]["separator"] == separator
        assert "<｜tool▁sep｜>" in auto["excludes"]
        named = get_parser(name).structural_tag(
            TOOLS, {"type": "function", "function": {"name": "search"}}, True)["format"]
        assert named["content"]["stop_after_first"] and len(named["content"]["tags"]) == 1


@pytest.mark.parametrize("name", NAMES)
def test_structural_tag_without_constraint(name):
    parser = get_parser(name)
    assert parser.structural_tag(TOOLS, "none", True) is None
    assert parser.structural_tag([], "auto", True) is None
    assert parser.structural_tag(None, None, True) is None


@pytest.mark.parametrize("choice", [
    {"type": "function", "function": {"name": "nope"}}, "sometimes", {"type": "function"}])
def test_bad_tool_choice_names_the_field(choice):
    with pytest.raises(ValueError, match="tool_choice"):
        get_parser("hermes").structural_tag(TOOLS, choice, True)


def test_bad_tools_name_the_field():
    with pytest.raises(ValueError, match="tool_choice"):
        get_parser("hermes").structural_tag([], "required", True)
    with pytest.raises(ValueError, match="tools"):
        get_parser("hermes").structural_tag([{"type": "function"}], "auto", True)
    with pytest.raises(ValueError, match="tools"):
        get_parser("hermes").structural_tag(TOOLS + TOOLS[:1], "auto", True)


def test_get_parser_and_default_parser():
    assert isinstance(get_parser("hermes"), HermesToolParser)
    with pytest.raises(ValueError, match="hermes"):
        get_parser("unknown")
    assert default_parser((TEMPLATES_DIR / "hermes_tools.jinja").read_text()) == "hermes"
    assert default_parser("{{ '[TOOL_CALLS]' + tool_calls | tojson }}") == "mistral"
    assert default_parser("{{- '<|python_tag|>' + tool_call.name }}") == "llama3_json"
    assert default_parser('ipython ... {"name": function name, "parameters": ...}') == (
        "llama3_json")
    # as the models' own templates write their calls
    assert default_parser("{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}") == (
        "qwen3_coder")
    assert default_parser("{{- '[TOOL_CALLS]' + tool.function.name + '[ARGS]' }}") == (
        "mistral_v11")
    assert default_parser("'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + name + "
                          "'\\n' + '```json' + '\\n'") == "deepseek_v3"
    assert default_parser("'<｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>' + arguments") == (
        "deepseek_v31")
    assert default_parser((TEMPLATES_DIR / "chat_fallback.jinja").read_text()) is None
    assert default_parser(None) is None


def test_bounded_strings_admit_no_control_characters(walker):
    compiler = walker[0]
    tag = get_parser("mistral").structural_tag(TOOLS, "required", False)
    compiled = compiler.compile_structural_tag(structural_tag_json(tag))
    begin = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "a'
    for text, ok in [("b", True), ("\x00", False), ("\t", False), ("é" * 11, True),
                     ("é" * 12, False)]:
        assert xgr.GrammarMatcher(compiled).accept_string(begin + text + '"') is ok


# -- valid by construction ---------------------------------------------------------------------

@dataclass
class Walker:
    """Random replies under a compiled grammar, drawn more and more toward closing tokens
    (``"``, ``}``, ``]``) and mostly away from whitespace, so that they end."""

    vocab: list[bytes]
    closers: set[int]
    stops: set[int]
    banned: set[int]  # see the fixture
    blank: set[int]

    def walk(self, compiled: xgr.CompiledGrammar, rng: random.Random, prefix: str = "",
             again: str = "") -> str | None:
        """One reply, None past 500 tokens (XML calls take many). Where the reply could end,
        ``again`` (up to twice) opens a further call. Free text may end inside a UTF-8
        sequence (xgrammar's free text is bytes): U+FFFD, as a detokenizer would show it."""
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string(prefix)
        bitmask = xgr.allocate_token_bitmask(1, len(self.vocab))
        out, agains = [prefix.encode()], 0
        for step in range(500):
            matcher.fill_next_token_bitmask(bitmask)
            bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
            allowed = [int(t) for t in np.flatnonzero(bits[:len(self.vocab)])]
            can_stop = any(t in self.stops for t in allowed)
            if can_stop and again and agains < 2 and rng.random() < 0.4:
                assert matcher.accept_string(again)
                out.append(again.encode())
                agains += 1
                continue
            token = self._pick(allowed, can_stop, step, rng)
            assert matcher.accept_token(token)
            if matcher.is_terminated():
                return b"".join(out).decode(errors="replace")
            out.append(self.vocab[token])
        return None

    def _pick(self, allowed: list[int], can_stop: bool, step: int, rng: random.Random) -> int:
        if can_stop and rng.random() < 0.5:
            return next(t for t in allowed if t in self.stops)
        allowed = [t for t in allowed if t not in self.stops and t not in self.banned] or allowed
        if rng.random() < 0.8:
            allowed = [t for t in allowed if t not in self.blank] or allowed
        closing = [t for t in allowed if t in self.closers]
        if closing and rng.random() < min(0.85, step / RAMP):
            allowed = closing
        return rng.choice(allowed)


RAMP = 100
# Lead bytes after which xgrammar's JSON strings admit sequences that are not UTF-8:
# surrogates (ED A0-BF ..) and, through ``pattern``, overlong forms (E0 80-9F .., F0 80-8F ..).
# A real model, trained on UTF-8 text, doesn't write them; a random walk would.
LENIENT_LEADS = frozenset([0xC0, 0xC1, 0xE0, 0xED, 0xF0, *range(0xF4, 0x100)])


@pytest.fixture(scope="module")
def walker():
    tokenizer = build_tokenizer(512)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    vocab = info.decoded_vocab
    closers = {i for i, b in enumerate(vocab) if b and set(b) <= set(b'"}]')}
    banned = {i for i, b in enumerate(vocab) if LENIENT_LEADS & set(b)}
    blank = {i for i, b in enumerate(vocab) if b and not b.strip()}
    walker = Walker(vocab, closers, set(info.stop_token_ids), banned, blank)
    return xgr.GrammarCompiler(info), walker


CHOICES = [("auto", True), ("auto", False), ("required", True), ("required", False),
           ({"type": "function", "function": {"name": "get_weather"}}, True)]
# what opens a further call where an "auto" reply may end; "" for formats whose one block of
# calls ends the reply
AGAIN = {"hermes": "\n<tool_call>", "llama3_json": '; {"name": ', "mistral": "",
         "mistral_v11": "[TOOL_CALLS]", "qwen3_coder": "\n<tool_call>", "deepseek_v3": "",
         "deepseek_v31": ""}
# the formats whose grammar holds the text their parser reads; openai's holds the raw Harmony
# reply, which the gpt_oss splitter rewrites first (test_harmony_tools.py walks it)
WALKED = [n for n in NAMES if n != "openai"]


@pytest.mark.parametrize("name", WALKED)
@pytest.mark.parametrize("choice,parallel", CHOICES)
def test_constrained_replies_parse_and_validate(walker, name, choice, parallel):
    compiler, walker = walker
    parser = get_parser(name, TOOLS)
    compiled = compiler.compile_structural_tag(structural_tag_json(
        parser.structural_tag(TOOLS, choice, parallel)))
    rng = random.Random(f"{name}{choice}{parallel}")
    replies = []
    for _ in range(16):
        if choice == "auto":  # free text, then the trigger
            prefix = rng.choice(["", "Let me check. ", "ok\n"]) + parser.trigger
            text = walker.walk(compiled, rng, prefix, AGAIN[name] if parallel else "")
        else:
            text = walker.walk(compiled, rng)
        if text is not None:
            replies.append(text)
    assert len(replies) >= 10
    for text in replies:
        check_constrained_reply(parser, text, choice, parallel)


def check_constrained_reply(parser: ToolParser, text: str, choice, parallel: bool) -> None:
    reply = assert_streams_like_extract(parser, text)
    assert reply.tool_calls, text
    assert len(reply.tool_calls) == 1 or parallel and choice in ("auto", "required")
    for call in reply.tool_calls:
        assert call.name in SCHEMAS and (choice in ("auto", "required")
                                         or call.name == "get_weather")
        assert "\ufffd" not in call.arguments
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    if choice == "auto":
        assert parser.trigger.strip() not in (reply.content or "")
    else:
        assert reply.content is None


@pytest.mark.parametrize("name", WALKED)
def test_a_named_function_is_called_exactly_once(walker, name):
    """After the one call of a named ``tool_choice`` the grammar ends (parallel calls
    allowed or not): a second call cannot begin, and only a stop token can follow."""
    compiler, walker = walker
    parser = get_parser(name, TOOLS)
    named = {"type": "function", "function": {"name": "ping"}}
    compiled = compiler.compile_structural_tag(structural_tag_json(
        parser.structural_tag(TOOLS, named, True)))
    call = render_calls(name, [("ping", '{"x": 1}')])
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_string(call)
    assert not xgr.GrammarMatcher(compiled).accept_string(call + AGAIN[name].strip() + "{")
    bitmask = xgr.allocate_token_bitmask(1, len(walker.vocab))
    matcher.fill_next_token_bitmask(bitmask)
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
    allowed = {int(t) for t in np.flatnonzero(bits[:len(walker.vocab)])}
    assert allowed and allowed <= walker.stops
