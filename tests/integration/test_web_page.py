"""The web chat page at ``/``, driven in a real headless Chromium over the DevTools protocol."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets

from bench.processes import LaunchedServer, stop_process
from tests.integration.test_websocket_server import LONG, turn_frames, ws_url
from tests.live_server import (
    DEVICE_ARGS,
    aborted,
    build_chat_model,
    running_server,
    wait_until_idle,
)
from tidal.app.chat_template import ChatTemplate
from tidal.app.conversation import truncation_reserve

# A stuck stream must fail its test, not stall the suite.
pytestmark = pytest.mark.timeout(180)

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
    "--disable-default-apps", "--mute-audio", "--window-size=1100,800",
    "--remote-debugging-port=0",
]


class BrowserError(RuntimeError):
    pass


class Browser:
    """A headless Chromium and one page tab, driven over the Chrome DevTools Protocol."""

    def __init__(self) -> None:
        self.profile = Path(tempfile.mkdtemp(prefix="tidal-chromium-"))
        self.proc: subprocess.Popen | None = None
        self.conn: Any = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None

    async def start(self, timeout: float = 60.0) -> None:
        exe = shutil.which("chromium") or shutil.which("chromium-browser")
        if exe is None:
            raise BrowserError("chromium is not installed (apt-get install chromium)")
        self.proc = subprocess.Popen(
            [exe, *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port = await self._debugging_port(timeout)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as resp:
            targets = json.loads(resp.read())
        page = next(t for t in targets if t["type"] == "page")
        self.conn = await websockets.connect(page["webSocketDebuggerUrl"], max_size=None)
        self._reader = asyncio.create_task(self._read())
        await self.call("Page.enable")
        await self.call("Runtime.enable")

    async def _debugging_port(self, timeout: float) -> int:
        """Chromium writes the port it picked to DevToolsActivePort in its profile."""
        marker = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BrowserError(f"chromium exited with status {self.proc.returncode}")
            text = marker.read_text() if marker.exists() else ""
            if text.strip():
                return int(text.split()[0])
            await asyncio.sleep(0.1)
        raise BrowserError("chromium did not open its debugging port")

    async def _read(self) -> None:
        async for raw in self.conn:
            message = json.loads(raw)
            future = self._pending.pop(message.get("id"), None)
            if future is not None and not future.done():
                future.set_result(message)

    async def call(self, method: str, **params: Any) -> dict:
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        await self.conn.send(json.dumps({"id": call_id, "method": method, "params": params}))
        message = await asyncio.wait_for(future, 60)
        if "error" in message:
            raise BrowserError(f"{method}: {message['error']}")
        return message.get("result", {})

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression,
                                 returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 60.0) -> Any:
        """Poll ``expression`` in the page until it is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"timed out waiting for {expression!r}")
            await asyncio.sleep(0.05)

    async def navigate(self, url: str) -> None:
        await self.call("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete'")

    async def type_text(self, text: str) -> None:
        await self.call("Input.insertText", text=text)

    async def press_enter(self) -> None:
        key = dict(key="Enter", code="Enter", windowsVirtualKeyCode=13, nativeVirtualKeyCode=13)
        await self.call("Input.dispatchKeyEvent", type="keyDown", text="\r", **key)
        await self.call("Input.dispatchKeyEvent", type="keyUp", **key)

    async def click(self, selector: str) -> None:
        """A real mouse click in the middle of the element."""
        box = await self.evaluate(
            f"(() => {{ const r = document.querySelector({json.dumps(selector)})"
            ".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        for kind in ("mousePressed", "mouseReleased"):
            await self.call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1],
                            button="left", clickCount=1)

    async def screenshot(self) -> bytes:
        result = await self.call("Page.captureScreenshot", format="png")
        return base64.b64decode(result["data"])

    async def close(self) -> None:
        if self.conn is not None:
            await self.conn.close()
        if self._reader is not None:
            self._reader.cancel()
        if self.proc is not None:
            stop_process(self.proc, 10)
        shutil.rmtree(self.profile, ignore_errors=True)


# -- the tests -------------------------------------------------------------------------------
GREEDY = {"max_tokens": 12, "temperature": 0}
LAST_REPLY = "[...document.querySelectorAll('.msg.assistant')].pop()"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("page-server")
    with running_server(build_chat_model(tmp / "model"), "--kv-cache-memory", "64MiB") as srv:
        yield srv.url


@contextlib.asynccontextmanager
async def open_page(base: str) -> AsyncIterator[Browser]:
    browser = Browser()
    try:
        await browser.start()
        await browser.navigate(base + "/")
        await browser.wait_for("window.tidalChat && window.tidalChat.connected")
        yield browser
    finally:
        await browser.close()


async def set_field(browser: Browser, element_id: str, value: object) -> None:
    await browser.evaluate(f"document.getElementById({json.dumps(element_id)}).value = "
                           f"{json.dumps(str(value))}")


async def send_message(browser: Browser, text: str) -> None:
    """Type into the message box like a user, then press Enter."""
    await browser.evaluate("document.getElementById('input').focus()")
    await browser.type_text(text)
    await browser.press_enter()


async def reference_reply(base: str, messages: list[dict], **params: object) -> str:
    """The same request straight over the websocket."""
    async with websockets.connect(ws_url(base)) as ws:
        await ws.send(json.dumps({"messages": messages, **params}))
        deltas, done = await turn_frames(ws)
    assert done["type"] == "done", done
    return "".join(d["text"] for d in deltas)


@pytest.mark.slow
@pytest.mark.integration
async def test_page_streams_replies_and_keeps_the_conversation(server: str) -> None:
    async with open_page(server) as page:
        await set_field(page, "max-tokens", GREEDY["max_tokens"])
        await set_field(page, "temperature", GREEDY["temperature"])
        # Record what the last reply bubble shows while it is still streaming.
        await page.evaluate(f"""(() => {{
            window.seen = [];
            new MutationObserver(() => {{
                const reply = {LAST_REPLY};
                if (reply) seen.push([reply.classList.contains('streaming'),
                                      reply.querySelector('.bubble').textContent]);
            }}).observe(document.getElementById('messages'),
                        {{subtree: true, childList: true, characterData: true}});
        }})()""")
        for turn, text in enumerate(("Hello there", "Tell me more.")):
            await send_message(page, text)
            await page.wait_for(f"tidalChat.history.length === {2 * turn + 2}")
            history = await page.evaluate("tidalChat.history")
            assert history[2 * turn] == {"role": "user", "content": text}
            reply = history[2 * turn + 1]
            assert reply["role"] == "assistant" and reply["content"]
            assert await page.evaluate(f"{LAST_REPLY}.querySelector('.bubble').textContent") \
                == reply["content"]
            assert await page.evaluate(f"{LAST_REPLY}.dataset.finishReason") in ("stop",
                                                                                  "length")
            assert "tokens" in await page.evaluate(f"{LAST_REPLY}.querySelector('.meta')"
                                                   ".textContent")
            # The page sent the whole conversation: the server answers the same to it.
            assert reply["content"] == await reference_reply(
                server, history[:2 * turn + 1], **GREEDY)
        seen = await page.evaluate("seen")
        assert any(streaming and partial for streaming, partial in seen), seen
        assert await page.evaluate("document.querySelectorAll('.msg.user').length") == 2
        assert await page.evaluate("document.querySelectorAll('.msg.assistant').length") == 2
        assert await page.evaluate("document.getElementById('input').value") == ""


@pytest.mark.slow
@pytest.mark.integration
async def test_page_stop_button_cancels_the_reply(server: str) -> None:
    before = aborted(wait_until_idle(server))
    async with open_page(server) as page:
        await set_field(page, "max-tokens", LONG)
        await page.evaluate("tidalChat.options.ignore_eos = true")
        await send_message(page, "Talk for a long time.")
        await page.wait_for(f"tidalChat.streaming && {LAST_REPLY}"
                            ".querySelector('.bubble').textContent.length > 0")
        assert await page.evaluate("document.getElementById('send').hidden")
        await page.click("#stop")
        await page.wait_for("!tidalChat.streaming")
        assert await page.evaluate(f"{LAST_REPLY}.dataset.finishReason") == "abort"
        assert "stopped" in await page.evaluate(f"{LAST_REPLY}.querySelector('.meta')"
                                                ".textContent")
        history = await page.evaluate("tidalChat.history")
        assert len(history) == 2 and history[1]["content"] == await page.evaluate(
            f"{LAST_REPLY}.querySelector('.bubble').textContent")
        assert aborted(wait_until_idle(server)) == before + 1
        # The page carries on: a short reply, then a new chat clears everything.
        await set_field(page, "max-tokens", 3)
        await send_message(page, "Short, please.")
        await page.wait_for("tidalChat.history.length === 4")
        assert await page.evaluate(f"{LAST_REPLY}.dataset.finishReason") == "length"
        await page.click("#new-chat")
        assert await page.evaluate("tidalChat.history.length") == 0
        assert await page.evaluate("document.querySelectorAll('.msg').length") == 0


# -- the embedded model, as a newcomer meets it ------------------------------------------------
# Ten messages a newcomer might type; together they outgrow the embedded model's 256-token
# context whatever the replies (each exchange is at least 15 tokens, and the page leaves half
# the context for the reply).
NEWCOMER = [
    "Tell me a joke",
    "Tell me another joke, about a king and his fool.",
    "What did the fool say to the king at supper?",
    "And what did the queen think of all this?",
    "Tell me about the weather in Verona in the spring.",
    "Who is the bravest knight in all of England?",
    "Sing me a short song about the sea and the moon.",
    "What would Romeo say to Juliet at her window?",
    "Tell me a story about a ghost in the castle.",
    "Thank you, good night and farewell, my friend.",
]


class EmbeddedModelServer(LaunchedServer):
    """``python -m tidal serve`` with no model: the embedded one."""

    def command(self) -> list[str]:
        return [sys.executable, "-m", "tidal", "serve", "--port", str(self.port),
                *self.server_args]


@pytest.fixture(scope="module")
def embedded_server() -> Iterator[str]:
    server = EmbeddedModelServer("", DEVICE_ARGS)
    try:
        server.wait_ready(300)
        yield server.url
    finally:
        server.stop()


def served_model(base: str) -> dict:
    with urllib.request.urlopen(base + "/v1/models", timeout=30) as resp:
        (model,) = json.loads(resp.read())["data"]
    return model


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
async def test_page_defaults_chat_for_ten_turns_on_the_embedded_model(
        embedded_server: str) -> None:
    """The page as it opens, settings untouched: every message gets a reply, and once the
    conversation outgrows the context the oldest turns are dropped, and the page says so."""
    from transformers import AutoTokenizer

    from tidal.core import DEFAULT_MODEL

    context = served_model(embedded_server)["max_model_len"]
    assert context == 256
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    template = ChatTemplate.for_tokenizer(tokenizer)

    def prompt_tokens(messages: list[dict]) -> int:
        return len(tokenizer.encode(template.render(messages), add_special_tokens=False))

    async with open_page(embedded_server) as page:
        assert await page.evaluate("tidalChat.contextTokens") == context
        assert await page.evaluate("document.getElementById('max-tokens').value") == ""
        assert await page.evaluate("document.getElementById('temperature').value") == "0.7"
        dropped_ever = False
        for turn, text in enumerate(NEWCOMER):
            history = await page.evaluate("tidalChat.history")
            start = await page.evaluate("tidalChat.contextStart")
            sent = [*history[start:], {"role": "user", "content": text}]
            await send_message(page, text)
            await page.wait_for("document.querySelectorAll('.msg.assistant:not(.streaming)')"
                                f".length === {turn + 1}", timeout=120)
            reply = await page.evaluate(f"""(() => {{ const r = {LAST_REPLY};
                return {{error: r.classList.contains('error'), reason: r.dataset.finishReason,
                         text: r.querySelector('.bubble').textContent,
                         meta: r.querySelector('.meta').textContent}}; }})()""")
            assert not reply["error"], (turn, text, reply)
            assert reply["reason"] in ("stop", "length") and "tokens" in reply["meta"], reply
            history = await page.evaluate("tidalChat.history")
            assert len(history) == 2 * turn + 2
            assert history[-2:] == [{"role": "user", "content": text},
                                    {"role": "assistant", "content": reply["text"]}]
            # The server dropped the oldest turns exactly when what the page sent left less
            # than the reply's room; the page stops sending them and says so.
            new_start = await page.evaluate("tidalChat.contextStart")
            outgrown = prompt_tokens(sent) + truncation_reserve(context) > context
            assert (new_start > start) == outgrown, (turn, start, new_start)
            assert new_start % 2 == 0 and new_start <= 2 * turn
            if outgrown:
                kept = prompt_tokens(sent[new_start - start:])
                assert kept + truncation_reserve(context) <= context
            dropped_ever |= outgrown
            note = await page.evaluate("""(() => { const n = document.getElementById(
                'dropped-note'); return n && n.offsetParent !== null ? n.textContent : null;
                })()""")
            if dropped_ever:
                assert note is not None and f"{context}-token context" in note, note
                # the note sits right above the first message still sent, after the faded ones
                assert await page.evaluate(
                    "document.querySelectorAll('.msg.dropped').length") == new_start
                assert await page.evaluate(
                    "document.getElementById('dropped-note').nextElementSibling"
                    ".classList.contains('user')")
            else:
                assert note is None
        assert dropped_ever, "ten turns did not outgrow the context"
        assert await page.evaluate("document.querySelectorAll('.msg.error').length") == 0
        # New chat: the whole context again, and no note.
        await page.click("#new-chat")
        assert await page.evaluate("tidalChat.contextStart") == 0
        assert await page.evaluate("document.getElementById('dropped-note')") is None
