"""Hypothesis-made request bodies against the app in-process (a real engine on a tiny model):
any JSON, any field of a valid request replaced by any value, deep nesting. None gets a 5xx,
and none holds the event loop (each is answered within ``ANSWER_WITHIN_S``)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from tidal.app.routes import build_app
from tidal.app.server_state import ServerSettings
from tidal.core.async_engine import AsyncEngine
from tidal.core.config import EngineConfig

ANSWER_WITHIN_S = 10.0  # a 4xx takes milliseconds; a valid request runs a few tokens
CHAT = [{"role": "user", "content": "Tell me a joke"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    from tidal.gpu.random_model import build_model_dir

    model = build_model_dir(tmp_path_factory.mktemp("fuzz") / "tiny", "llama")
    engine = AsyncEngine(EngineConfig(model=str(model), kv_cache_memory=4 << 20,
                                      max_num_seqs=16))
    # a request that validates runs at most 1 s, whatever max_tokens or n it asks for
    app = build_app(engine, ServerSettings(served_model_name="tiny", request_timeout=1.0,
                                           max_request_bytes=256 << 10))
    with TestClient(app) as test_client:
        yield test_client


_scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
            | st.floats(allow_nan=False) | st.text(max_size=20))
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
_FIELDS = ["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "n", "stop",
           "stream", "stream_options", "logprobs", "top_logprobs", "seed", "response_format",
           "tools", "tool_choice", "presence_penalty", "frequency_penalty", "logit_bias",
           "echo", "timeout", "priority", "max_completion_tokens", "ignore_eos", "best_of"]


@st.composite
def _mutated(draw: Any) -> tuple[str, Any]:
    """A valid chat or completion request with some fields replaced by any JSON."""
    chat = draw(st.booleans())
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 2}
    body.update({"messages": CHAT} if chat else {"prompt": "Once upon"})
    for name in draw(st.lists(st.sampled_from(_FIELDS), max_size=3, unique=True)):
        body[name] = draw(_json)
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def _deep(depth: int) -> bytes:
    return b'{"model": "tiny", "messages": ' + b"[" * depth + b"]" * depth + b"}"


def _check(client: TestClient, path: str, raw: bytes) -> None:
    started = time.monotonic()
    resp = client.post(path, content=raw)
    elapsed = time.monotonic() - started
    assert resp.status_code < 500, (raw[:300], resp.status_code, resp.text[:300])
    assert elapsed < ANSWER_WITHIN_S, (raw[:300], elapsed)
    if resp.status_code >= 400:
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(request=_mutated())
def test_mutated_requests_never_get_a_5xx(client: TestClient, request: tuple[str, Any]) -> None:
    path, body = request
    _check(client, path, json.dumps(body).encode())


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=_json, chat=st.booleans())
def test_any_json_never_gets_a_5xx(client: TestClient, body: Any, chat: bool) -> None:
    _check(client, "/v1/chat/completions" if chat else "/v1/completions",
           json.dumps(body).encode())


@pytest.mark.parametrize("depth", [100, 1000, 50_000])
def test_deep_nesting_never_gets_a_5xx(client: TestClient, depth: int) -> None:
    _check(client, "/v1/chat/completions", _deep(depth))
    _check(client, "/v1/completions", _deep(depth).replace(b"messages", b"prompt"))


def test_bytes_that_are_no_json_never_get_a_5xx(client: TestClient) -> None:
    for raw in (b"\xff\xfe", b"{" * 10_000, b'{"model": "tiny", "messages": "\xc3"}', b"\x00",
                b"1e999999", b'{"model": 1e400}', b"[" * 300_000):
        _check(client, "/v1/chat/completions", raw)
