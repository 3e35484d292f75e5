"""A reply's thinking kept apart from its answer: ``<think>...</think>`` to
``reasoning_content``, the same whether the reply arrives whole or in any deltas."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.app.test_tool_parsers import chunkings
from tidal.app.reasoning import (
    FORMATS,
    ReasoningSplitter,
    default_format,
    get_format,
    split_reasoning,
    splitter_for,
)

QWEN3, R1 = get_format("qwen3"), get_format("deepseek_r1")


def streamed(fmt, pieces: list[str]) -> tuple[str | None, str]:
    splitter = splitter_for(fmt)
    deltas = [splitter.feed(p) for p in pieces] + [splitter.finish()]
    return "".join(d.reasoning for d in deltas) or None, "".join(d.content for d in deltas)


@pytest.mark.parametrize("fmt,text,expected", [
    (QWEN3, "<think>\nLet me see.\n</think>\n\nParis.", ("\nLet me see.\n", "Paris.")),
    (QWEN3, "Paris.", (None, "Paris.")),  # thinking off: all answer
    (QWEN3, "<thin", (None, "<thin")),  # no block after all
    (QWEN3, "<think>cut off by max_to", ("cut off by max_to", "")),
    (QWEN3, "Answer with </think> inside", (None, "Answer with </think> inside")),
    (R1, "I should answer.</think>\n\nParis.", ("I should answer.", "Paris.")),
    (R1, "<think>I should answer.</think>Paris.", ("I should answer.", "Paris.")),
    (R1, "still thinking", ("still thinking", "")),
])
def test_thinking_and_answer(fmt, text, expected):
    assert split_reasoning(fmt, text) == expected
    for seed, pieces in enumerate(chunkings(text, 0)):
        assert streamed(fmt, pieces) == expected, (seed, pieces)


def test_a_possible_end_marker_is_held_back():
    splitter = ReasoningSplitter(QWEN3)
    assert splitter.feed("<think>abc</thi").reasoning == "abc"
    delta = splitter.feed("nk>\n\nok")
    assert (delta.reasoning, delta.content) == ("", "ok")
    splitter = ReasoningSplitter(QWEN3)
    assert splitter.feed("<think>a </th").reasoning == "a "
    assert splitter.feed(">c").reasoning == "</th>c"
    assert ReasoningSplitter(QWEN3).feed("<think>a </b").reasoning == "a </b"


TEXT = st.text(alphabet=st.sampled_from(list("ab \n<>/thinkTK")), max_size=30)


@settings(max_examples=80, deadline=None)
@given(name=st.sampled_from(list(FORMATS)), before=TEXT, after=TEXT,
       opened=st.booleans(), closed=st.booleans(), seed=st.integers(0, 100))
def test_any_reply_streams_like_the_whole(name, before, after, opened, closed, seed):
    fmt = get_format(name)
    text = ("<think>" if opened else "") + before + ("</think>" if closed else "") + after
    whole = split_reasoning(fmt, text)
    for pieces in chunkings(text, seed):
        assert streamed(fmt, pieces) == whole
    if name == "qwen3" and not text.startswith("<think>"):
        assert whole == (None, text)  # no block: all answer


def test_the_chat_templates_markers_pick_the_format():
    assert default_format("{{ messages }}") is None
    assert default_format("{% if enable_thinking %}<think>{% endif %}") == "qwen3"
    assert default_format("<｜Assistant｜><think>\n") == "deepseek_r1"
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        get_format("o1")


# -- through the chat endpoint ----------------------------------------------------------------

ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
# where the template leaves the prompt: the reply may think, starts thinking, or may not
OPENINGS = {"maybe": "", "inside": "<think>\n", "closed": "<think>\n\n</think>\n\n"}


@pytest.fixture(scope="module")
def chat_client(tmp_path_factory: pytest.TempPathFactory):
    """A random model with ``<think>`` and ``</think>`` as single tokens, and a template
    (qwen3's format, by its markers) that ends the prompt where ``opening`` says."""
    from starlette.testclient import TestClient
    from transformers import AutoTokenizer

    from tidal.app.routes import build_app
    from tidal.app.server_state import ServerSettings
    from tidal.core.async_engine import AsyncEngine
    from tidal.core.config import EngineConfig
    from tidal.gpu.random_model import build_model_dir

    root = tmp_path_factory.mktemp("reasoning")
    model = build_model_dir(root / "m", "llama", max_position_embeddings=512,
                            added_tokens=("<think>", "</think>"))
    template = root / "thinking.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}\n{% endfor %}" + "".join(
        f"{{% if opening == '{name}' %}}{text}{{% endif %}}"
        for name, text in OPENINGS.items()))
    engine = AsyncEngine(EngineConfig(model=str(model), kv_cache_memory=8 << 20))
    app = build_app(engine, ServerSettings(served_model_name="m", chat_template=str(template)))
    tokenizer = AutoTokenizer.from_pretrained(model)
    with TestClient(app) as client:
        client.marker_ids = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
        yield client


def _chat(client, opening: str, seed: int, stream: bool, parser: str | None = None
          ) -> tuple[str | None, str, str]:
    """The reply's reasoning_content, content and finish_reason, for a JSON-schema answer
    (the markers made likely, so the random model thinks briefly)."""
    client.app.state.tidal.settings.reasoning_parser = parser
    body = {"model": "m", "messages": [{"role": "user", "content": "Capital of France?"}],
            "max_tokens": 60, "temperature": 1.0, "seed": seed, "stream": stream,
            "chat_template_kwargs": {"opening": opening},
            "logit_bias": {str(i): 6 for i in client.marker_ids},
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "a", "schema": ANSWER}}}
    if not stream:
        choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        message = choice["message"]
        assert ("reasoning_content" in message) == (parser != "none")
        return message.get("reasoning_content"), message["content"], choice["finish_reason"]
    import orjson

    reasoning, content, finish = "", "", None
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for choice in orjson.loads(line[6:])["choices"]:
                    reasoning += choice["delta"].get("reasoning_content") or ""
                    content += choice["delta"].get("content") or ""
                    finish = choice["finish_reason"] or finish
    return reasoning or None, content, finish


@pytest.mark.parametrize("opening", list(OPENINGS))
def test_the_schema_holds_the_answer_after_the_thinking(chat_client, opening):
    import jsonschema
    import orjson

    thought = 0
    for seed in range(8):
        thinking, answer, finish = _chat(chat_client, opening, seed, stream=False)
        assert finish == "stop", (seed, thinking, answer)
        jsonschema.validate(orjson.loads(answer), ANSWER)
        assert "<think>" not in answer and "</think>" not in answer
        thought += thinking is not None
        if opening == "closed":
            assert thinking is None  # the prompt closed the block: all answer
        assert _chat(chat_client, opening, seed, stream=True) == (thinking, answer, finish)
    if opening != "closed":
        assert thought >= 4  # the grammar let the model think, and the thinking was kept apart


def test_without_a_reasoning_parser_the_schema_holds_the_whole_reply(chat_client):
    import jsonschema
    import orjson

    for seed in range(4):
        thinking, answer, finish = _chat(chat_client, "maybe", seed, stream=False,
                                         parser="none")
        assert thinking is None and finish == "stop"
        jsonschema.validate(orjson.loads(answer), ANSWER)


def test_a_named_tool_is_called_after_the_thinking(chat_client):
    import orjson

    chat_client.app.state.tidal.settings.reasoning_parser = None
    tool = {"type": "function", "function": {"name": "ask", "parameters": ANSWER}}
    thought = 0
    for seed in range(6):
        body = {"model": "m", "messages": [{"role": "user", "content": "Ask."}],
                "max_tokens": 80, "temperature": 1.0, "seed": seed, "tools": [tool],
                "tool_choice": {"type": "function", "function": {"name": "ask"}},
                "logit_bias": {str(i): 6 for i in chat_client.marker_ids}}
        choice = chat_client.post("/v1/chat/completions", json=body).json()["choices"][0]
        message = choice["message"]
        assert choice["finish_reason"] == "tool_calls" and message["content"] is None
        (call,) = message["tool_calls"]
        assert orjson.loads(call["function"]["arguments"]).keys() == {"ok"}
        thought += message["reasoning_content"] is not None
    assert thought >= 3


@pytest.mark.parametrize("constraint,good,bad", [
    ({"json": ANSWER}, '{"ok": true}', '{"ok": 1}'),
    ({"json_object": True}, '{"a": [1]}', '[1]'),
    ({"regex": "[a-z]{2,4}"}, "abc", "abcdef"),
    ({"choice": ["yes", "no"]}, "no", "maybe"),
    ({"grammar": 'root ::= "x" "y"*'}, "xyy", "yx"),
    ({"structural_tag": {"type": "structural_tag",
                         "format": {"type": "const_string", "value": "done"}}}, "done", "don"),
])
@pytest.mark.parametrize("opening", list(OPENINGS))
def test_every_kind_of_constraint_follows_the_thinking(constraint, good, bad, opening):
    """The grammar a constraint becomes after a thinking block, on characters: the answer
    held to the constraint, the thinking free."""
    import xgrammar as xgr

    from tidal.app.structured import after_thinking
    from tidal.core.structured_output import StructuredOutputsParams
    from tidal.core.structured_output.compiler import structural_tag_json

    fmt = QWEN3.for_prompt("Q\n" + OPENINGS[opening])
    spec = after_thinking(StructuredOutputsParams(**constraint), fmt)
    assert spec is not None
    tag = spec.structural_tag if spec.structural_tag is not None else \
        {"type": "structural_tag", "format": spec.as_format()}
    vocab = [chr(i) for i in range(32, 127)] + ["\n", "</s>"]  # the last: the end
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])
    grammar = xgr.GrammarCompiler(info).compile_structural_tag(structural_tag_json(tag))
    thinking = {"maybe": "<think>free {text</think>\n\n", "inside": "free {text</think>\n",
                "closed": ""}[opening]

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(grammar)
        return matcher.accept_string(text) and matcher.accept_token(len(vocab) - 1)

    assert accepts(thinking + good) and not accepts(thinking + bad)
    # inside an opened block the thinking must end first; elsewhere it may be skipped
    assert accepts(good) == (opening != "inside")
