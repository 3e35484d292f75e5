"""A Harmony chat served end to end: a random model with Harmony's tokens, our Harmony
template (which picks the ``gpt_oss`` and ``openai`` parsers by itself), the grammar of a named
tool, and the reply split the same way whole and streamed."""

from __future__ import annotations

import orjson
import pytest

from tidal.templates import TEMPLATES_DIR

HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|channel|>", "<|message|>", "<|constrain|>",
                  "<|call|>", "<|return|>")
ASK = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
       "additionalProperties": False}


@pytest.fixture(scope="module")
def harmony_client(tmp_path_factory: pytest.TempPathFactory):
    from starlette.testclient import TestClient
    from transformers import AutoTokenizer

    from tidal.app.routes import build_app
    from tidal.app.server_state import ServerSettings
    from tidal.core.async_engine import AsyncEngine
    from tidal.core.config import EngineConfig
    from tidal.gpu.random_model import build_model_dir

    model = build_model_dir(tmp_path_factory.mktemp("harmony") / "m", "llama",
                            max_position_embeddings=1024, added_tokens=HARMONY_TOKENS)
    engine = AsyncEngine(EngineConfig(model=str(model), kv_cache_memory=16 << 20))
    template = str(TEMPLATES_DIR / "gpt_oss_harmony.jinja")
    app = build_app(engine, ServerSettings(served_model_name="m", chat_template=template))
    tokenizer = AutoTokenizer.from_pretrained(model)
    with TestClient(app) as client:
        client.marker_ids = tokenizer.convert_tokens_to_ids(list(HARMONY_TOKENS))
        yield client


def _body(seed: int, stream: bool, marker_ids: list[int]) -> dict:
    """A named call (Harmony's tokens made likely, so the random model writes them whole
    and thinks briefly)."""
    tool = {"type": "function", "function": {"name": "ask", "parameters": ASK}}
    return {"model": "m", "messages": [{"role": "user", "content": "Ask."}],
            "max_tokens": 48, "temperature": 1.0, "seed": seed, "stream": stream,
            "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "ask"}},
            "reasoning_effort": "low", "logit_bias": {str(i): 20 for i in marker_ids}}


def _streamed(client, body: dict) -> tuple[str | None, str | None, list, str | None]:
    reasoning, content, calls, finish = "", "", [], None
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for choice in orjson.loads(line[6:])["choices"]:
                    reasoning += choice["delta"].get("reasoning_content") or ""
                    content += choice["delta"].get("content") or ""
                    calls += [(c["function"]["name"], c["function"]["arguments"])
                              for c in choice["delta"].get("tool_calls") or []]
                    finish = choice["finish_reason"] or finish
    return reasoning or None, content or None, calls, finish


def test_a_named_tool_is_called_in_harmony(harmony_client):
    """A reply is the call, or (the random model's ``<|end|>`` is its end-of-text token,
    which the grammar does not let it write inside its thinking) thinking cut by
    ``max_tokens``; never Harmony's markup in the text. The first call is streamed too."""
    for seed in range(6, 22):  # seed 6 calls on the CPU; a GPU draws otherwise: more seeds
        body = _body(seed, False, harmony_client.marker_ids)
        choice = harmony_client.post("/v1/chat/completions", json=body).json()["choices"][0]
        message = choice["message"]
        thinking, calls = message["reasoning_content"], message.get("tool_calls") or []
        assert message["content"] is None
        assert not any(t in (thinking or "") for t in HARMONY_TOKENS)
        if choice["finish_reason"] == "length":
            assert calls == [] and thinking
            continue
        assert choice["finish_reason"] == "tool_calls"
        (call,) = calls
        assert call["function"]["name"] == "ask"
        assert orjson.loads(call["function"]["arguments"]).keys() == {"ok"}
        calls = [(call["function"]["name"], call["function"]["arguments"])]
        assert _streamed(harmony_client, {**body, "stream": True}) == (
            thinking, None, calls, "tool_calls")
        return
    pytest.fail("no seed called the tool")
