"""gpt-oss's Harmony replies split into reasoning and content (the ``gpt_oss`` reasoning
format), whole and streamed; our Harmony chat template; ``reasoning_effort`` reaching it.

The expected splits are written by hand from OpenAI's Harmony spec (openai/harmony), not
from our own output."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.app.test_tool_parsers import chunkings
from tidal.app.chat_template import ChatTemplate
from tidal.app.errors import ApiError
from tidal.app.harmony import HarmonySplitter
from tidal.app.metrics import ServerMetrics
from tidal.app.prepare import prepare_chat_request
from tidal.app.reasoning import FORMATS, default_format, split_reasoning, thinking_format
from tidal.app.responses_request import prepare_response_request
from tidal.app.server_state import ServerSettings, ServerState
from tidal.templates import TEMPLATES_DIR

GPT_OSS = FORMATS["gpt_oss"]
TEMPLATE = TEMPLATES_DIR / "gpt_oss_harmony.jinja"
A = "<|channel|>analysis<|message|>"
NEXT = "<|start|>assistant"
F = f"{NEXT}<|channel|>final<|message|>"
# a line of gpt-oss's own chat_template.jinja (openai/gpt-oss-20b), as it writes a call
REAL_TEMPLATE_LINE = ('{{- "<|start|>assistant to=" }}{{- "functions." + tool_call.name + '
                      '"<|channel|>commentary " }}{{- (tool_call.content_type if '
                      'tool_call.content_type is defined else "json") + "<|message|>" }}'
                      '{{- tool_call.arguments|tojson }}{{- "<|call|>" }}')


def streamed(fmt, pieces: list[str], calls: bool = False) -> tuple[str | None, str]:
    splitter = HarmonySplitter(fmt.closed, calls)
    reasoning, content = "", ""
    for delta in [*(splitter.feed(p) for p in pieces), splitter.finish()]:
        reasoning += delta.reasoning
        content += delta.content
    return reasoning or None, content


@pytest.mark.parametrize("text,expected", [
    (f"{A}Think.<|end|>{F}Answer.", ("Think.", "Answer.")),
    (f"{A}Think.<|end|>{F}Answer.<|return|>", ("Think.", "Answer.")),
    ("<|channel|>final<|message|>Just this.", (None, "Just this.")),
    ("A model that writes no Harmony", (None, "A model that writes no Harmony")),
    (f"{A}Cut in the mid", ("Cut in the mid", "")),
    (f"{A}Cut in the header<|end|>{NEXT}<|channel|>fin", ("Cut in the header", "")),
    # a preamble to the user (commentary, no recipient) is content, as in vLLM
    (f"{A}x<|end|>{NEXT}<|channel|>commentary<|message|>Let me look.<|end|>{F}Done.",
     ("x", "Let me look.Done.")),
    # a built-in tool (not offered here) and a function call without tools: dropped
    (f"{A}x<|end|>{NEXT}<|channel|>analysis to=browser.search <|constrain|>json<|message|>"
     '{"q": 1}<|call|>', ("x", "")),
    (f'{A}x<|end|>{NEXT} to=functions.f<|channel|>commentary json<|message|>{{}}', ("x", "")),
    # stray tokens inside a body are not text; a header without an end before it still opens
    (f"{A}a<|constrain|>b<|channel|>final<|message|>c<|message|>d", ("ab", "cd")),
    (f"{A}two{NEXT}<|channel|>analysis<|message|> parts<|end|>{F}ok", ("two parts", "ok")),
])
def test_messages_split_into_reasoning_and_content(text, expected):
    assert split_reasoning(GPT_OSS, text) == expected
    for pieces in chunkings(text, len(text)):
        assert streamed(GPT_OSS, pieces) == expected


def test_a_prompt_that_opened_the_final_message():
    fmt = GPT_OSS.for_prompt("<|start|>assistant<|channel|>final<|message|>")
    assert fmt.closed and thinking_format(fmt) is None
    assert split_reasoning(fmt, "<|x|> at once<|end|>") == (None, "<|x|> at once")
    assert not GPT_OSS.for_prompt("<|start|>assistant").closed


def test_a_possible_token_is_held_back():
    splitter = HarmonySplitter()
    assert splitter.feed(A + "Hmm <|e").reasoning == "Hmm "
    delta = splitter.feed("nd|><|start|>assistant<|channel|>final<|mess")
    assert (delta.reasoning, delta.content) == ("", "")
    assert splitter.feed("age|>Hi <").content == "Hi "
    assert splitter.finish().content == "<"


MESSAGES = st.lists(st.tuples(
    st.sampled_from(["analysis", "final", "commentary", "commentary to=functions.f"]),
    st.text(alphabet=st.sampled_from(list("ab <|>{}\":é")), max_size=12),
    st.sampled_from(["<|end|>", "<|return|>", "<|call|>", ""])), min_size=1, max_size=4)


@settings(max_examples=80, deadline=None)
@given(messages=MESSAGES, seed=st.integers(0, 1000), calls=st.booleans())
def test_any_reply_streams_like_the_whole(messages, seed, calls):
    text = "".join(f"{NEXT if i else ''}<|channel|>{header}<|message|>{body}{end}"
                   for i, (header, body, end) in enumerate(messages))
    whole = split_reasoning(GPT_OSS, text, calls)
    for pieces in chunkings(text, seed):
        assert streamed(GPT_OSS, pieces, calls) == whole
    reasoning, content = whole
    for token in ("<|end|>", "<|start|>", "<|return|>", "<|message|>", "<|channel|>"):
        assert token not in (reasoning or "")
        assert calls or token not in content  # calls: the canonical call text is content


def test_the_templates_select_gpt_oss():
    assert default_format(TEMPLATE.read_text()) == "gpt_oss"
    assert default_format(REAL_TEMPLATE_LINE) == "gpt_oss"
    assert default_format((TEMPLATES_DIR / "hermes_tools.jinja").read_text()) is None


# -- the template and reasoning_effort ---------------------------------------------------------

@pytest.fixture
def harmony_state(embedded_tokenizer: Any) -> ServerState:
    """A server's state without an engine, our Harmony template, parsers from the template."""
    from tests.unit.app.conftest import _NoEngine

    template = ChatTemplate.for_tokenizer(embedded_tokenizer, str(TEMPLATE))
    return ServerState(engine=_NoEngine(), tokenizer=embedded_tokenizer,  # type: ignore[arg-type]
                       settings=ServerSettings(served_model_name="m"), metrics=ServerMetrics(),
                       chat_template=template, max_model_len=4096,
                       vocab_size=len(embedded_tokenizer), kv_capacity_tokens=8192,
                       max_num_seqs=8)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


def test_reasoning_effort_reaches_the_template(harmony_state):
    prompt = prepare_chat_request(CHAT, harmony_state).prompt
    assert "Reasoning: medium\n" in prompt and prompt.endswith("<|start|>assistant")
    for effort in ("low", "medium", "high"):
        prep = prepare_chat_request({**CHAT, "reasoning_effort": effort}, harmony_state)
        assert f"Reasoning: {effort}\n" in prep.prompt
        assert prep.reasoning is not None and prep.reasoning.harmony
        assert prep.params.skip_special_tokens is False  # the splitter sees the tokens
    kwargs = {"chat_template_kwargs": {"reasoning_effort": "low"}}
    assert "Reasoning: low\n" in prepare_chat_request({**CHAT, **kwargs}, harmony_state).prompt
    prep = prepare_response_request({"input": "Hi", "reasoning": {"effort": "high"}},
                                    harmony_state)
    assert "Reasoning: high\n" in prep.chat.prompt
    assert prep.echo["reasoning"]["effort"] == "high"


@pytest.mark.parametrize("effort", ["extreme", "", 3, "HIGH"])
def test_a_bad_reasoning_effort_is_a_400_naming_the_field(harmony_state, effort):
    with pytest.raises(ApiError) as info:
        prepare_chat_request({**CHAT, "reasoning_effort": effort}, harmony_state)
    assert info.value.status == 400 and info.value.param == "reasoning_effort"
    with pytest.raises(ApiError) as info:
        prepare_response_request({"input": "Hi", "reasoning": {"effort": effort}},
                                 harmony_state)
    assert info.value.status == 400 and info.value.param == "reasoning.effort"
