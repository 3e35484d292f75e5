"""The real server process on a tiny random model, driven by real ``curl -N`` and the
official ``openai`` client: the SSE framing, streamed against whole answers, usage, ``n``,
stop strings, logprobs, /metrics and prefix caching (bad input, disconnects and shutdown:
``test_server_robustness.py``)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.live_server import (
    CHAT,
    GREEDY,
    Server,
    api_server,
    check_chat_stream,
    curl,
    sse_events,
)

pytestmark = [pytest.mark.gpu, pytest.mark.integration]
# the example, verbatim but for the model name
SEED_BODY = ('{"model": "...", "messages": [{"role": "user", "content": "Tell me a joke"}], '
             '"max_tokens": 100, "stream": true}')


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from api_server(tmp_path_factory)


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return server.openai()


# -- the seed example and SSE framing ---------------------------------------------------------
def test_seed_example_with_curl(server: Server, tmp_path: Path) -> None:
    headers = tmp_path / "headers"
    body = SEED_BODY.replace('"..."', json.dumps(server.model))
    raw = curl("-D", str(headers), f"http://localhost:{server.port}/v1/chat/completions",
                "-d", body)
    assert "content-type: text/event-stream" in headers.read_text().lower()
    events = sse_events(raw)
    texts = check_chat_stream(events)
    final = [e for e in events[:-1] if e["choices"][0]["finish_reason"]][0]
    assert final["choices"][0]["finish_reason"] in ("stop", "length")
    assert final["model"] == server.model and final["id"].startswith("chatcmpl-")
    assert isinstance(texts[0], str)


def test_curl_streamed_text_completion(server: Server) -> None:
    body = json.dumps({"model": server.model, "prompt": "Once upon a time", "max_tokens": 8,
                       "stream": True, **GREEDY})
    events = sse_events(curl(f"{server.url}/v1/completions", "-H", "Content-Type: text/plain",
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
    events = sse_events(curl(f"{server.url}/v1/chat/completions", "-d", json.dumps(body)))
    counts = [e["usage"]["completion_tokens"] for e in events[:-1]]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 6
    assert events[-2]["choices"] == []


def test_n_equals_two(server: Server, client: openai.OpenAI) -> None:
    full = server.chat(max_tokens=8, n=2, **GREEDY)
    assert [c["index"] for c in full["choices"]] == [0, 1]
    assert full["usage"]["completion_tokens"] == 16
    body = {"model": server.model, "messages": CHAT, "max_tokens": 8, "n": 2, "stream": True,
            **GREEDY}
    texts = check_chat_stream(sse_events(curl(f"{server.url}/v1/chat/completions", "-d",
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
    texts = check_chat_stream(sse_events(curl(f"{server.url}/v1/chat/completions", "-d",
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
        if "\ufffd" not in entry.token:  # else part of a character: its own bytes
            assert bytes(entry.bytes) == entry.token.encode()
    # the tokens' bytes, joined, are the reply's text, characters split over tokens included
    assert b"".join(bytes(e.bytes) for e in content).decode(errors="replace") == \
        full.choices[0].message.content
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
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the prompt, scored
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
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
    check_chat_stream(sse_events(curl(f"{server.url}/v1/chat/completions", "-d",
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
