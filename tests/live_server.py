"""The real server process (``python -m tidal serve``) for the integration tests, and how they
talk to it: its OpenAI API over httpx and ``curl -N``, the SSE framing of its streams, its
``/metrics`` and when its engine has gone idle."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

from bench.processes import LaunchedServer
from bench.server_metrics import parse_metrics
from tests.device import GPU_TEST_KV_CACHE, TEST_DEVICE

Metrics = dict[str, float]  # sample name with labels -> value
ABORTS = 'tidal:request_success_total{finished_reason="abort"}'
EVENT = re.compile(rb"data: ([^\n]+)\n\n")
CHAT = [{"role": "user", "content": "Tell me a joke"}]
GREEDY = {"temperature": 0.0, "ignore_eos": True}
DEVICE_ARGS = ([] if TEST_DEVICE == "cpu" else
               ["--device", TEST_DEVICE, "--kv-cache-memory", str(GPU_TEST_KV_CACHE)])


@contextlib.contextmanager
def running_server(model_dir: Path, *args: str, timeout: float = 300.0
                   ) -> Iterator[LaunchedServer]:
    """The server on ``model_dir`` with ``args``, on a free port, once /health answers."""
    server = LaunchedServer(str(model_dir), [*DEVICE_ARGS, *args])
    try:
        server.wait_ready(timeout)
        yield server
    finally:
        server.stop()


def build_chat_model(path: Path) -> Path:
    """A tiny random Llama with a chat template and room for 2,048 tokens."""
    from tidal.gpu.random_model import build_model_dir

    return build_model_dir(path, "llama", max_position_embeddings=2048)


def metrics(base: str) -> Metrics:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as resp:
        return parse_metrics(resp.read().decode())


def wait_metrics(base: str, check: Callable[[Metrics], bool], what: str,
                 timeout: float = 60.0) -> Metrics:
    """Poll /metrics until ``check(values)`` holds (the engine applies aborts within a step,
    the scrape sees them right after)."""
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(base)
        if check(values):
            return values
        assert time.monotonic() < deadline, f"{what}: metrics never got there: {values}"
        time.sleep(0.05)


def is_idle(values: Metrics) -> bool:
    """No request runs or waits and no KV block is in use."""
    return (values["tidal:num_requests_running"] == values["tidal:num_requests_waiting"] == 0
            and values["tidal:kv_cache_used_blocks"] == 0)


def wait_until_idle(base: str) -> Metrics:
    return wait_metrics(base, is_idle, "the engine going idle")


def aborted(values: Metrics) -> float:
    return values.get(ABORTS, 0.0)


def finished(values: Metrics) -> float:
    return sum(v for k, v in values.items() if k.startswith("tidal:request_success_total{"))


# -- the OpenAI API ---------------------------------------------------------------------------
@dataclass
class Server:
    """A running server's OpenAI API, as the tests call it."""

    url: str
    port: int
    model: str

    def post(self, path: str, body: Any, **kwargs: Any) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=60, **kwargs)

    def chat(self, **fields: Any) -> dict:
        resp = self.post("/v1/chat/completions", {"model": self.model, "messages": CHAT,
                                                  **fields})
        assert resp.status_code == 200, resp.text
        return resp.json()

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def metrics(self) -> Metrics:
        return metrics(self.url)

    def wait_metrics(self, check: Callable[[Metrics], bool], what: str) -> Metrics:
        return wait_metrics(self.url, check, what)


def api_server(tmp_path_factory: Any) -> Iterator[Server]:
    """A module's server on a tiny chat model, with a small KV cache and a 64 KiB body limit
    (the body of a fixture)."""
    model = build_chat_model(tmp_path_factory.mktemp("serve") / "tiny")
    with running_server(model, "--kv-cache-memory", "8MiB", "--max-request-bytes",
                        "64KiB") as srv:
        yield Server(srv.url, srv.port, str(model))


def curl(*args: str, timeout: float = 120) -> bytes:
    done = subprocess.run(["curl", "-sN", "--max-time", str(int(timeout)), *args],
                          capture_output=True, timeout=timeout + 10, check=True)
    return done.stdout


def sse_events(raw: bytes) -> list[Any]:
    """The SSE events of a whole stream, checking it is nothing but ``data: X\\n\\n``."""
    assert EVENT.sub(b"", raw) == b"", f"stray bytes in the stream: {raw!r}"
    return [e if e == b"[DONE]" else json.loads(e) for e in EVENT.findall(raw)]


def check_chat_stream(events: list[Any], n: int = 1) -> dict[int, str]:
    """Protocol checks of a streamed chat answer; returns each choice's text."""
    assert events[-1] == b"[DONE]" and b"[DONE]" not in events[:-1]
    chunks = [e for e in events[:-1] if e["choices"]]
    assert len({e["id"] for e in events[:-1]}) == 1
    texts: dict[int, str] = {}
    finishes: dict[int, int] = {}
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk"
        (choice,) = chunk["choices"]
        index = choice["index"]
        assert "finish_reason" in choice
        if index not in texts:
            assert choice["delta"] == {"role": "assistant", "content": ""}
            texts[index] = ""
        else:
            assert "role" not in choice["delta"]
            assert index not in finishes, "a chunk after the choice's finish reason"
        texts[index] += choice["delta"].get("content", "")
        if choice["finish_reason"] is not None:
            finishes[index] = finishes.get(index, 0) + 1
    assert sorted(texts) == list(range(n)) and finishes == dict.fromkeys(range(n), 1)
    return texts
