"""The web chat page shows a reasoning model's thinking in a collapsed block and its tool calls
apart from the answer, as they stream, in a real headless Chromium."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import pytest

from tests.integration.test_web_page import LAST_REPLY, open_page, send_message, set_field
from tests.live_server import running_server

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow, pytest.mark.integration]

ASK = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
       "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "ask", "parameters": ASK}}


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """A random model whose template opens ``<think>`` in the prompt (``</think>`` a single
    token), and that token's id."""
    from transformers import AutoTokenizer

    from tidal.gpu.random_model import build_model_dir

    tmp = tmp_path_factory.mktemp("thinking-page")
    model = build_model_dir(tmp / "model", "llama", max_position_embeddings=2048,
                            added_tokens=("<think>", "</think>"))
    template = tmp / "thinking.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}\n{% endfor %}<think>\n")
    end = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids("</think>")
    with running_server(model, "--chat-template", str(template), "--kv-cache-memory",
                        "64MiB") as srv:
        yield srv.url, end


def _http_reply(base: str, body: dict) -> dict:
    with urllib.request.urlopen(base + "/v1/models", timeout=30) as resp:
        body = {"model": json.loads(resp.read())["data"][0]["id"], **body}
    request = urllib.request.Request(base + "/v1/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.loads(resp.read())["choices"][0]


def _a_seed_that_thinks(base: str, end: int) -> tuple[dict, dict]:
    """The page's request options with the first seed whose reply (over HTTP) thinks before
    its call (``</think>`` is favoured, so a draw may close the thinking at once), and that
    reply."""
    for seed in range(16):
        options = {"tools": [TOOL], "seed": seed, "logit_bias": {str(end): 8},
                   "tool_choice": {"type": "function", "function": {"name": "ask"}}}
        reply = _http_reply(base, {"messages": [{"role": "user", "content": "Ask."}],
                                   "max_tokens": 80, "temperature": 1.0, **options})
        if reply["message"]["reasoning_content"]:
            return options, reply
    raise AssertionError("no seed of 16 gave a reply that thinks")


async def test_page_shows_the_thinking_collapsed_and_the_tool_call(thinking_server) -> None:
    base, end = thinking_server
    options, expected = _a_seed_that_thinks(base, end)
    async with open_page(base) as page:
        await set_field(page, "max-tokens", 80)
        await set_field(page, "temperature", 1.0)
        await page.evaluate(f"Object.assign(tidalChat.options, {json.dumps(options)})")
        await page.evaluate(f"""(() => {{
            window.seen = [];
            new MutationObserver(() => {{
                const reply = {LAST_REPLY};
                const thought = reply && reply.querySelector('details.thinking .thought');
                if (thought) seen.push([reply.classList.contains('streaming'),
                                        thought.textContent]);
            }}).observe(document.getElementById('messages'),
                        {{subtree: true, childList: true, characterData: true}});
        }})()""")
        await send_message(page, "Ask.")
        await page.wait_for("tidalChat.history.length === 2")
        shown = await page.evaluate(f"""(() => {{ const r = {LAST_REPLY};
            const block = r.querySelector('details.thinking');
            return {{reason: r.dataset.finishReason, open: block && block.open,
                     thought: block && block.querySelector('.thought').textContent,
                     calls: [...r.querySelectorAll('.call')].map((c) => c.textContent),
                     bubble: r.querySelector('.bubble').hidden}}; }})()""")
        reply = (await page.evaluate("tidalChat.history"))[1]
        seen = await page.evaluate("seen")
    message = expected["message"]
    assert shown["reason"] == expected["finish_reason"] == "tool_calls"
    assert message["reasoning_content"] and shown["thought"] == message["reasoning_content"]
    assert shown["open"] is False  # collapsed
    assert any(streaming for streaming, _ in seen)  # shown while it streamed
    (call,) = message["tool_calls"]
    assert shown["calls"] == [f"⚙ ask {call['function']['arguments']}"]
    assert shown["bubble"] is True  # no answer text: only the call
    assert [c["function"] for c in reply["tool_calls"]] == [call["function"]]
    assert reply["content"] == "" and "<think>" not in json.dumps(reply)
