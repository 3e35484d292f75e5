"""``use_beam_search`` on ``/v1/completions``: the offline search's beams (themselves checked
against HF transformers in tests/unit/core/test_beam_search.py), and 400s naming what a beam
search cannot take."""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.testclient import TestClient

from tests.unit.app.test_api_unit import _engine_config, model_dir  # noqa: F401
from tidal.app.routes import build_app
from tidal.app.server_state import ServerSettings
from tidal.core.async_engine import AsyncEngine
from tidal.core.beam_search import BeamSearchParams
from tidal.core.llm import LLM

PROMPTS = [[5, 17, 42, 99, 3, 250, 77, 31], [300, 12, 7]]


@pytest.fixture(scope="module")
def client(model_dir: Path):  # noqa: F811
    app = build_app(AsyncEngine(_engine_config(model_dir)),
                    ServerSettings(served_model_name="tiny"))
    with TestClient(app) as client:
        yield client


def test_the_api_returns_the_offline_beams(client: TestClient,
                                           model_dir: Path) -> None:  # noqa: F811
    body = {"model": "tiny", "prompt": PROMPTS, "use_beam_search": True, "n": 3,
            "max_tokens": 5, "length_penalty": 0.5, "early_stopping": "never"}
    answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    reply = answer.json()
    llm = LLM(str(model_dir), kv_cache_memory=4 << 20)
    beams = llm.beam_search(PROMPTS, BeamSearchParams(3, 5, length_penalty=0.5,
                                                      early_stopping="never"))
    want = [b for found in beams for b in found]
    assert [c["index"] for c in reply["choices"]] == list(range(6))
    assert [c["text"] for c in reply["choices"]] == [b.text for b in want]
    assert [c["finish_reason"] for c in reply["choices"]] == [b.finish_reason for b in want]
    for choice, beam in zip(reply["choices"], want):
        assert choice["score"] == pytest.approx(beam.score, abs=1e-5)
    assert reply["usage"]["completion_tokens"] == sum(len(b.tokens) for b in want)
    assert reply["usage"]["prompt_tokens"] == sum(len(p) for p in PROMPTS)


@pytest.mark.parametrize("extra, field", [({"stream": True}, "stream"), ({"n": 11}, "n"),
                                          ({"logprobs": 2}, "logprobs"),
                                          ({"early_stopping": "sometimes"}, "early_stopping")])
def test_what_a_beam_search_cannot_take_is_a_400_naming_it(client: TestClient, extra: dict,
                                                          field: str) -> None:
    body = {"model": "tiny", "prompt": "hi", "use_beam_search": True, "n": 2,
            "max_tokens": 3, **extra}
    answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == field
