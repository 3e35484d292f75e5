"""Tool calls that never break, sampled at temperature 1.0 over 50 seeds for every format:
on the embedded model, whose tokenizer spells the markers (``<tool_call>``, ``[TOOL_CALLS]``,
``<|python_tag|>``, ``<｜tool▁sep｜>``, ...) as plain text, and on a random model that has them
as single special tokens and prompts with the format's own chat template where tidal ships one.
A named function gives exactly one call, ``required`` one or more, ``auto`` only valid calls;
no call markup ever reaches the content, a reply cut by ``max_tokens`` included; the streamed
reply is the whole reply, delta by delta."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import orjson
import pytest
from starlette.testclient import TestClient

from tidal.app.chat_template import ChatTemplate
from tidal.app.routes import build_app
from tidal.app.server_state import ServerSettings
from tidal.app.tool_parsers import PARSERS, get_parser
from tidal.core.async_engine import AsyncEngine
from tidal.core.config import DEFAULT_MODEL, EngineConfig
from tidal.gpu.random_model import build_model_dir
from tidal.templates import TEMPLATES_DIR

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SEEDS = 50
SUMMON = {"type": "object", "properties": {"who": {"type": "string", "maxLength": 16},
                                           "urgent": {"type": "boolean"}},
          "required": ["who", "urgent"], "additionalProperties": False}
BANISH = {"type": "object", "properties": {"where": {"enum": ["France", "Wales"]}},
          "required": ["where"], "additionalProperties": False}
SCHEMAS = {"summon": SUMMON, "banish": BANISH}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": s}}
         for n, s in SCHEMAS.items()]
CHAT = [{"role": "user", "content": "Describe a knight as JSON."}]
NAMED = {"type": "function", "function": {"name": "summon"}}
# tool_choice, max_tokens (past what the format's markers take), whether the call(s) can be
# cut short
CASES = {"named": (NAMED, 120), "required": ("required", 120), "auto": ("auto", 120),
         "cut": ("required", 14)}
SPECIAL_MARKERS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>",
                   "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                   "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")
# the formats' own chat templates, for the model that knows their markers (else Hermes')
TEMPLATES = {"qwen3_coder": "qwen3_coder_tools.jinja", "mistral_v11": "mistral_v11_tools.jinja",
             "deepseek_v3": "deepseek_v3_tools.jinja", "deepseek_v31": "deepseek_v31_tools.jinja"}


def _client(model: str, chat_template: str | None) -> Iterator[TestClient]:
    engine = AsyncEngine(EngineConfig(model=model, kv_cache_memory=64 << 20,
                                      max_num_seqs=SEEDS))
    app = build_app(engine, ServerSettings(served_model_name="m", chat_template=chat_template))
    with TestClient(app) as client:
        yield client


@pytest.fixture(scope="module", params=["plain-text markers", "special-token markers"])
def client(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    if request.param == "plain-text markers":
        yield from _client(DEFAULT_MODEL, None)
        return
    model: Path = build_model_dir(tmp_path_factory.mktemp("tools") / "special", "llama",
                                  max_position_embeddings=1024, added_tokens=SPECIAL_MARKERS)
    yield from _client(str(model), str(TEMPLATES_DIR / "hermes_tools.jinja"))


def _ask(client: TestClient, parser: str, case: str, stream: bool) -> list[dict[str, Any]]:
    """The ``SEEDS`` choices of one request (seed 0 + i for choice i), each as
    ``{"content", "calls": [(name, arguments)], "finish"}``."""
    state = client.app.state.tidal
    state.settings.tool_call_parser = parser
    if state.settings.chat_template is not None:
        template = TEMPLATES_DIR / TEMPLATES.get(parser, "hermes_tools.jinja")
        state.chat_template = ChatTemplate.for_tokenizer(state.tokenizer, str(template))
    tool_choice, max_tokens = CASES[case]
    if case != "cut":
        max_tokens = _budget(state, parser, max_tokens)
    body = {"model": "m", "messages": CHAT, "tools": TOOLS, "tool_choice": tool_choice,
            "n": SEEDS, "seed": 0, "temperature": 1.0, "max_tokens": max_tokens,
            "stream": stream}
    if not stream:
        resp = client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        return [{"content": c["message"]["content"], "finish": c["finish_reason"],
                 "calls": [(t["function"]["name"], t["function"]["arguments"])
                           for t in c["message"].get("tool_calls") or []]}
                for c in sorted(resp.json()["choices"], key=lambda c: c["index"])]
    choices = [{"content": "", "calls": [], "finish": None} for _ in range(SEEDS)]
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = orjson.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                _add_delta(choices[choice["index"]], choice)
    for choice in choices:
        choice["content"] = choice["content"] or None
    return choices


def _budget(state: Any, parser: str, max_tokens: int) -> int:
    """``max_tokens`` past what the format's markers may take, one token a byte at most (the
    model may spell a special token out byte by byte), within the room the prompt leaves."""
    markup = sum(len(m.encode()) for m in get_parser(parser).markers())
    prompt = state.chat_template.render(CHAT, tools=TOOLS)
    room = state.context_tokens - len(state.tokenizer.encode(prompt, add_special_tokens=False))
    return min(max_tokens + markup, room)


def _add_delta(choice: dict[str, Any], event: dict[str, Any]) -> None:
    delta = event["delta"]
    choice["content"] += delta.get("content") or ""
    for item in delta.get("tool_calls") or []:
        assert item["index"] == len(choice["calls"])  # each call arrives whole
        choice["calls"].append((item["function"]["name"], item["function"]["arguments"]))
    choice["finish"] = event["finish_reason"] or choice["finish"]


def _check(choice: dict[str, Any], parser: str, case: str) -> None:
    content = choice["content"] or ""
    assert [m for m in get_parser(parser).markers() if m in content] == [], choice
    for name, arguments in choice["calls"]:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    if case == "named":
        assert [name for name, _ in choice["calls"]] == ["summon"], choice
        assert choice["finish"] == "tool_calls" and choice["content"] is None, choice
    elif case == "required":
        assert choice["calls"] and choice["content"] is None, choice
        assert choice["finish"] in ("tool_calls", "length"), choice
    elif case == "cut":
        assert choice["finish"] == "length" and choice["content"] is None, choice


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("parser", list(PARSERS))
def test_tool_calls_never_break(client: TestClient, parser: str, case: str) -> None:
    whole = _ask(client, parser, case, stream=False)
    for choice in whole:
        _check(choice, parser, case)
    assert _ask(client, parser, case, stream=True) == whole
