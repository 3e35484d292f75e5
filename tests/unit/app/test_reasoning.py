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
)

QWEN3, R1 = get_format("qwen3"), get_format("deepseek_r1")


def streamed(fmt, pieces: list[str]) -> tuple[str | None, str]:
    splitter = ReasoningSplitter(fmt)
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

REPLY = r"<think>[a-z]{2,6}</think>\n\n[a-z]{2,6}"  # the reply's shape, held by a regex


@pytest.fixture(scope="module")
def chat_client(tmp_path_factory: pytest.TempPathFactory):
    from starlette.testclient import TestClient

    from tidal.app.routes import build_app
    from tidal.app.server_state import ServerSettings
    from tidal.core.async_engine import AsyncEngine
    from tidal.core.config import EngineConfig
    from tidal.gpu.random_model import build_model_dir

    root = tmp_path_factory.mktemp("reasoning")
    model = build_model_dir(root / "m", "llama", max_position_embeddings=512)
    template = root / "thinking.jinja"  # a template that teaches <think>: qwen3's format
    template.write_text("{# the model may open <think> #}"
                        "{% for m in messages %}{{ m.content }}\n{% endfor %}")
    engine = AsyncEngine(EngineConfig(model=str(model), kv_cache_memory=8 << 20))
    app = build_app(engine, ServerSettings(served_model_name="m", chat_template=str(template)))
    with TestClient(app) as client:
        yield client


def _chat(client, stream: bool, parser: str | None) -> tuple[str | None, str]:
    client.app.state.tidal.settings.reasoning_parser = parser
    body = {"model": "m", "messages": [{"role": "user", "content": "Capital of France?"}],
            "max_tokens": 40, "temperature": 1.0, "seed": 7, "stream": stream,
            "structured_outputs": {"regex": REPLY}}
    if not stream:
        message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert ("reasoning_content" in message) == (parser != "none")
        return message.get("reasoning_content"), message["content"]
    reasoning, content = "", ""
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                import orjson

                for choice in orjson.loads(line[6:])["choices"]:
                    reasoning += choice["delta"].get("reasoning_content") or ""
                    content += choice["delta"].get("content") or ""
    return reasoning or None, content


def test_the_thinking_reaches_reasoning_content(chat_client):
    thinking, answer = _chat(chat_client, stream=False, parser=None)  # sniffed: qwen3
    assert thinking and thinking.isalpha() and answer.isalpha()
    assert _chat(chat_client, stream=True, parser=None) == (thinking, answer)
    assert _chat(chat_client, stream=False, parser="none") == (
        None, f"<think>{thinking}</think>\n\n{answer}")
