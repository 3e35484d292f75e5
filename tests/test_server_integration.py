"""The real server process (``python -m app serve``) on a tiny random model, driven by real
``curl -N``, the official ``openai`` client, raw sockets and httpx."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from bench.processes import free_port, stop_process
from bench.server_metrics import parse_metrics

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
EVENT = re.compile(rb"data: ([^\n]+)\n\n")
CHAT = [{"role": "user", "content": "Tell me a joke"}]
GREEDY = {"temperature": 0.0, "ignore_eos": True}
# the example, verbatim but for the model name
SEED_BODY = ('{"model": "...", "messages": [{"role": "user", "content": "Tell me a joke"}], '
             '"max_tokens": 100, "stream": true}')


@dataclass
class Server:
    url: str
    port: int
    model: str
    proc: subprocess.Popen
    log: Path

    def post(self, path: str, body: Any, **kwargs: Any) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=60, **kwargs)

    def chat(self, **fields: Any) -> dict:
        resp = self.post("/v1/chat/completions", {"model": self.model, "messages": CHAT,
                                                  **fields})
        assert resp.status_code == 200, resp.text
        return resp.json()

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=30).text)

    def wait_metrics(self, check: Any, what: str, timeout: float = 60.0) -> dict[str, float]:
        """Poll /metrics until ``check(values)`` holds (the engine applies aborts within a
        step, the scrape sees them right after)."""
        deadline = time.monotonic() + timeout
        while True:
            values = self.metrics()
            if check(values):
                return values
            if time.monotonic() > deadline:
                pytest.fail(f"{what}: metrics never got there: {values}")
            time.sleep(0.05)


def _start(model_dir: Path, log: Path, *extra: str) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "app", "serve", "--model", str(model_dir), "--port", str(port),
           "--kv-cache-memory", "8MiB", *extra]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(f"http://127.0.0.1:{port}", port, str(model_dir), proc, log)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(server.url + "/health", timeout=5).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    _stop(server)
    pytest.fail(f"the server did not come up:\n{log.read_text()}")


def _stop(server: Server) -> int:
    return stop_process(server.proc, 60)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gpu.random_model import build_model_dir

    return build_model_dir(tmp_path_factory.mktemp("serve") / "tiny", "llama",
                           max_position_embeddings=2048)


@pytest.fixture(scope="session")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = _start(tiny_model, tmp_path_factory.mktemp("logs") / "server.log",
                 "--max-request-bytes", "64KiB")
    yield srv
    _stop(srv)


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _curl(*args: str, timeout: float = 120) -> bytes:
    done = subprocess.run(["curl", "-sN", "--max-time", str(int(timeout)), *args],
                          capture_output=True, timeout=timeout + 10, check=True)
    return done.stdout


def _events(raw: bytes) -> list[Any]:
    """The SSE events of a whole stream, checking it is nothing but ``data: X\\n\\n``."""
    assert EVENT.sub(b"", raw) == b"", f"stray bytes in the stream: {raw!r}"
    return [e if e == b"[DONE]" else json.loads(e) for e in EVENT.findall(raw)]


def _check_chat_stream(events: list[Any], n: int = 1) -> dict[int, str]:
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


# -- the seed example and SSE framing ---------------------------------------------------------
def test_seed_example_with_curl(server: Server, tmp_path: Path) -> None:
    headers = tmp_path / "headers"
    body = SEED_BODY.replace('"..."', json.dumps(server.model))
    raw = _curl("-D", str(headers), f"http://localhost:{server.port}/v1/chat/completions",
                "-d", body)
    assert "content-type: text/event-stream" in headers.read_text().lower()
    events = _events(raw)
    texts = _check_chat_stream(events)
    final = [e for e in events[:-1] if e["choices"][0]["finish_reason"]][0]
    assert final["choices"][0]["finish_reason"] in ("stop", "length")
    assert final["model"] == server.model and final["id"].startswith("chatcmpl-")
    assert isinstance(texts[0], str)


def test_curl_streamed_text_completion(server: Server) -> None:
    body = json.dumps({"model": server.model, "prompt": "Once upon a time", "max_tokens": 8,
                       "stream": True, **GREEDY})
    events = _events(_curl(f"{server.url}/v1/completions", "-H", "Content-Type: text/plain",
                           "-d", body))
    assert events[-1] == b"[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and "finish_reason" in c["choices"][0]
               for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("length") == 1
    full = server.post("/v1/completions", {**json.loads(body), "stream": False}).json()
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]


# -- the openai client --------------------------------------------------------------------------
def test_streamed_chat_equals_non_streamed_greedy_text(server: Server,
                                                       client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=24,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert full.object == "chat.completion" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 24
    assert full.usage.total_tokens == full.usage.prompt_tokens + 24
    stream = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=24,
                                            temperature=0, extra_body={"ignore_eos": True},
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full.choices[0].message.content and text


def test_streamed_completion_equals_non_streamed_greedy_text(server: Server,
                                                             client: openai.OpenAI) -> None:
    kwargs = dict(model=server.model, prompt="The quick brown fox", max_tokens=20,
                  temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    stream = client.completions.create(**kwargs, stream=True)
    text = "".join(c.choices[0].text for c in stream)
    assert text == full.choices[0].text and full.usage.completion_tokens == 20


def test_include_usage(server: Server, client: openai.OpenAI) -> None:
    full = server.chat(max_tokens=12, **GREEDY)
    chunks = list(client.chat.completions.create(
        model=server.model, messages=CHAT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert last.usage.completion_tokens == 12
    assert last.usage.prompt_tokens == full["usage"]["prompt_tokens"]
    assert last.usage.total_tokens == last.usage.prompt_tokens + 12


def test_continuous_usage_stats(server: Server) -> None:
    body = {"model": server.model, "messages": CHAT, "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}, **GREEDY}
    events = _events(_curl(f"{server.url}/v1/chat/completions", "-d", json.dumps(body)))
    counts = [e["usage"]["completion_tokens"] for e in events[:-1]]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 6
    assert events[-2]["choices"] == []


def test_n_equals_two(server: Server, client: openai.OpenAI) -> None:
    full = server.chat(max_tokens=8, n=2, **GREEDY)
    assert [c["index"] for c in full["choices"]] == [0, 1]
    assert full["usage"]["completion_tokens"] == 16
    body = {"model": server.model, "messages": CHAT, "max_tokens": 8, "n": 2, "stream": True,
            **GREEDY}
    texts = _check_chat_stream(_events(_curl(f"{server.url}/v1/chat/completions", "-d",
                                             json.dumps(body))), n=2)
    assert [texts[0], texts[1]] == [c["message"]["content"] for c in full["choices"]]
    # text completions: two prompts x n=2 -> choice indices 0..3, prompt-major
    comp = client.completions.create(model=server.model, prompt=["one", "two"], n=2,
                                     max_tokens=4, temperature=0)
    assert sorted(c.index for c in comp.choices) == [0, 1, 2, 3]
    assert comp.choices[0].text == comp.choices[1].text  # greedy: same prompt, same text


def test_stop_strings(server: Server) -> None:
    text = server.chat(max_tokens=30, **GREEDY)["choices"][0]["message"]["content"]
    candidates = [m.group(0) for m in re.finditer(r"[A-Za-z]{2,}", text)]
    assert candidates, f"no stop-string candidate in {text!r}"
    stop = candidates[len(candidates) // 2]
    full = server.chat(max_tokens=30, stop=[stop], **GREEDY)
    choice = full["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == text[:text.index(stop)]
    body = {"model": server.model, "messages": CHAT, "max_tokens": 30, "stop": stop,
            "stream": True, **GREEDY}
    texts = _check_chat_stream(_events(_curl(f"{server.url}/v1/chat/completions", "-d",
                                             json.dumps(body))))
    assert texts[0] == text[:text.index(stop)]


def test_chat_logprobs(server: Server, client: openai.OpenAI) -> None:
    full = client.chat.completions.create(
        model=server.model, messages=CHAT, max_tokens=10, temperature=0, logprobs=True,
        top_logprobs=3, extra_body={"ignore_eos": True})
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens == 10
    for entry in content:
        tops = entry.top_logprobs
        assert len(tops) == 3 and [t.logprob for t in tops] == sorted(
            (t.logprob for t in tops), reverse=True)
        assert entry.logprob <= 0 and entry.token == tops[0].token  # greedy took the best
        assert entry.logprob == pytest.approx(tops[0].logprob)
        assert bytes(entry.bytes) == entry.token.encode()
    stream = client.chat.completions.create(
        model=server.model, messages=CHAT, max_tokens=10, temperature=0, logprobs=True,
        top_logprobs=3, extra_body={"ignore_eos": True}, stream=True)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content])
    plain = server.chat(max_tokens=3)
    assert plain["choices"][0]["logprobs"] is None


def test_completion_logprobs_and_echo(server: Server, client: openai.OpenAI) -> None:
    prompt = "The quick brown fox"
    out = client.completions.create(model=server.model, prompt=prompt, max_tokens=5,
                                    temperature=0, logprobs=2, echo=True,
                                    extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    num_prompt = out.usage.prompt_tokens
    assert len(lp.tokens) == num_prompt + 5 == len(lp.token_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[:num_prompt] == [None] * num_prompt
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[num_prompt:])
    assert all(len(t) <= 2 for t in lp.top_logprobs[num_prompt:])
    assert "".join(lp.tokens) == choice.text
    plain = client.completions.create(model=server.model, prompt=prompt, max_tokens=5,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert choice.text == prompt + plain.choices[0].text


def test_models_health_and_metrics(server: Server, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [server.model]
    assert httpx.get(server.url + "/health").status_code == 200
    before = server.metrics()
    server.chat(max_tokens=4, **GREEDY)
    after = server.metrics()
    for name in ("tidal:num_requests_running", "tidal:num_requests_waiting",
                 "tidal:kv_cache_usage_perc", "tidal:prefix_cache_hit_rate",
                 "tidal:prefix_cache_queries_total", "tidal:prefix_cache_hits_total",
                 "tidal:time_to_first_token_seconds_count",
                 "tidal:inter_token_latency_seconds_count",
                 "tidal:e2e_request_latency_seconds_count"):
        assert name in after, name
    assert after["tidal:generation_tokens_total"] - before.get(
        "tidal:generation_tokens_total", 0) == 4
    assert after["tidal:e2e_request_latency_seconds_count"] - before.get(
        "tidal:e2e_request_latency_seconds_count", 0) == 1
    assert after['tidal:request_success_total{finished_reason="length"}'] >= 1
    for name in ("tidal:event_loop_cpu_seconds_total", "process_cpu_seconds_total"):
        assert after[name] >= before[name] > 0
    delivered = "tidal:output_delivery_latency_seconds_count"
    body = {"model": server.model, "messages": CHAT, "max_tokens": 4, "stream": True, **GREEDY}
    _check_chat_stream(_events(_curl(f"{server.url}/v1/chat/completions", "-d",
                                     json.dumps(body))))
    assert server.metrics()[delivered] - after.get(delivered, 0) >= 1


def test_cached_prompt_tokens_are_reported(server: Server) -> None:
    messages = [{"role": "user", "content": "Numbers like 12345 and 678.9 appear. " * 6}]
    first = server.post("/v1/chat/completions", {"model": server.model, "messages": messages,
                                                 "max_tokens": 2}).json()
    second = server.post("/v1/chat/completions", {"model": server.model, "messages": messages,
                                                  "max_tokens": 2}).json()
    assert first["usage"]["prompt_tokens"] == second["usage"]["prompt_tokens"] > 32
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] % 16 == 0


# -- bad input --------------------------------------------------------------------------------
def _bad_cases(model: str) -> list[tuple[str, bytes, int, str | None]]:
    chat = "/v1/chat/completions"
    comp = "/v1/completions"

    def body(**fields: Any) -> bytes:
        return json.dumps({"model": model, "messages": CHAT, **fields}).encode()

    long_chat = json.dumps({"model": model, "messages": [
        {"role": "user", "content": "fox " * 2100}]}).encode()
    return [
        (chat, b'{"model": "x", "messages": [', 400, None),
        (chat, b"[1, 2]", 400, None),
        (chat, b"", 400, None),
        (chat, json.dumps({"messages": CHAT}).encode(), 400, "model"),
        (chat, json.dumps({"model": model}).encode(), 400, "messages"),
        (chat, body(messages="hello"), 400, "messages"),
        (chat, body(messages=[{"role": "robot", "content": "hi"}]), 400, "messages[0].role"),
        (chat, body(messages=[{"role": "user", "content": 7}]), 400, "messages[0].content"),
        (chat, body(temperature="hot"), 400, "temperature"),
        (chat, body(temperature=-0.5), 400, "temperature"),
        (chat, body(top_p=2), 400, "top_p"),
        (chat, body(max_tokens="10"), 400, "max_tokens"),
        (chat, body(max_tokens=-1), 400, "max_tokens"),
        (chat, body(n=0), 400, "n"),
        (chat, body(stop=[1, 2]), 400, "stop"),
        (chat, body(logprobs=True, top_logprobs=99), 400, "top_logprobs"),
        (chat, body(stream_options={"include_usage": True}), 400, "stream_options"),
        (chat, long_chat, 400, "messages"),
        (chat, body(max_tokens=100_000), 400, "max_tokens"),
        (chat, body(model="no-such-model"), 404, "model"),
        (comp, json.dumps({"model": model}).encode(), 400, "prompt"),
        (comp, json.dumps({"model": model, "prompt": [1, "a"]}).encode(), 400, "prompt"),
        (comp, json.dumps({"model": model, "prompt": [10**7]}).encode(), 400, "prompt"),
        (comp, json.dumps({"model": model, "prompt": "hi", "logprobs": 50}).encode(), 400,
         "logprobs"),
        (comp, json.dumps({"model": model, "prompt": "hi", "max_tokens": 4000}).encode(), 400,
         "max_tokens"),
        (comp, json.dumps({"model": model, "prompt": "x" * 70_000}).encode(), 413, None),
    ]


def test_bad_input_gets_openai_errors_and_the_server_keeps_serving(server: Server) -> None:
    for path, raw, status, param in _bad_cases(server.model):
        resp = httpx.post(server.url + path, content=raw, timeout=60)
        assert resp.status_code == status, (raw[:200], resp.text)
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["param"] == param and error["message"], (raw[:200], error)
    assert httpx.get(server.url + "/health").status_code == 200
    assert server.chat(max_tokens=3)["choices"][0]["finish_reason"] in ("stop", "length")


def test_oversized_body_without_content_length_is_413(server: Server) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "x", "prompt": "'
        for _ in range(40):
            yield b"y" * 4096
        yield b'"}'

    resp = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=60)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"


def test_unknown_routes_and_methods_get_json_errors(server: Server) -> None:
    missing = httpx.get(server.url + "/v1/nothing")
    assert missing.status_code == 404 and "error" in missing.json()
    wrong = httpx.get(server.url + "/v1/chat/completions")
    assert wrong.status_code == 405 and "error" in wrong.json()


def test_openai_client_raises_on_bad_input(client: openai.OpenAI, server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.model, messages=CHAT, n=0)
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-nothing", messages=CHAT)


# -- disconnects and load ---------------------------------------------------------------------
def _open_stream(server: Server, body: dict) -> socket.socket:
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                 b"Content-Type: application/json\r\nContent-Length: "
                 + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    return sock


def _read_until(sock: socket.socket, count: int) -> bytes:
    data = b""
    while data.count(b"data: ") < count:
        chunk = sock.recv(65536)
        assert chunk, f"the stream ended early: {data!r}"
        data += chunk
    return data


def _idle(values: dict[str, float]) -> bool:
    return (values["tidal:num_requests_running"] == 0
            and values["tidal:num_requests_waiting"] == 0
            and values["tidal:kv_cache_used_blocks"] == 0)


ABORTS = 'tidal:request_success_total{finished_reason="abort"}'


def test_streams_closed_midway_leave_nothing_running(server: Server) -> None:
    aborts = server.metrics().get(ABORTS, 0)
    body = {"model": server.model, "messages": CHAT, "max_tokens": 1800, "stream": True,
            **GREEDY}
    socks = [_open_stream(server, body) for _ in range(8)]
    for sock in socks:
        assert b" 200 " in _read_until(sock, 3).split(b"\r\n", 1)[0]
    server.wait_metrics(lambda v: v["tidal:num_requests_running"] == 8, "8 running")
    for sock in socks:
        sock.close()
    values = server.wait_metrics(_idle, "all aborted and freed")
    assert values["tidal:kv_cache_usage_perc"] == 0
    assert values[ABORTS] - aborts == 8
    assert httpx.get(server.url + "/health").status_code == 200


def test_non_streamed_request_is_aborted_when_the_client_leaves(server: Server) -> None:
    aborts = server.metrics().get(ABORTS, 0)
    body = {"model": server.model, "messages": CHAT, "max_tokens": 1800, **GREEDY}
    sock = _open_stream(server, body)
    server.wait_metrics(lambda v: v["tidal:num_requests_running"] == 1, "1 running")
    sock.close()
    values = server.wait_metrics(_idle, "aborted and freed")
    assert values[ABORTS] - aborts == 1


def test_32_concurrent_streams_all_finish(server: Server) -> None:
    async def one(client: httpx.AsyncClient, i: int) -> bytes:
        body = {"model": server.model, "max_tokens": 16, "stream": True,
                "messages": [{"role": "user", "content": f"Story number {i}"}], **GREEDY}
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            return b"".join([chunk async for chunk in resp.aiter_bytes()])

    async def all_of_them() -> list[bytes]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(all_of_them())
    for raw in results:
        texts = _check_chat_stream(_events(raw))
        assert texts[0]
    server.wait_metrics(_idle, "all finished")


# -- API key and shutdown, on a server of their own -------------------------------------------
@pytest.mark.slow
def test_api_key_and_clean_shutdown(tiny_model: Path, tmp_path: Path) -> None:
    srv = _start(tiny_model, tmp_path / "server.log", "--api-key", "sekrit",
                 "--served-model-name", "tiny-secure")
    try:
        body = {"model": "tiny-secure", "messages": CHAT, "max_tokens": 3}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            resp = srv.post("/v1/chat/completions", body, headers=headers)
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        assert httpx.get(srv.url + "/health").status_code == 200
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekrit", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-secure"]
        out = client.chat.completions.create(model="tiny-secure", messages=CHAT, max_tokens=3)
        assert out.choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.NotFoundError):  # the served name, not the path, is the id
            client.chat.completions.create(model=str(tiny_model), messages=CHAT, max_tokens=3)

        stream = client.chat.completions.create(model="tiny-secure", messages=CHAT,
                                                max_tokens=1800, stream=True,
                                                extra_body={"ignore_eos": True})
        next(iter(stream))
        srv.proc.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError, match="shutting down|shut down|not running"):
            for _ in stream:
                pass
        assert srv.proc.wait(60) == 0
    finally:
        _stop(srv)

