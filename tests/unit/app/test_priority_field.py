"""``priority`` on the APIs (vLLM's field): refused by name on an fcfs server, and on a
``--scheduling-policy priority`` server a request that outranks a running one takes its place
in a full batch."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from tests.unit.app.test_api_unit import CHAT, model_dir, state, tokenizer  # noqa: F401
from tidal.app.errors import ApiError
from tidal.app.prepare import prepare_chat_request, prepare_completion_request
from tidal.app.routes import build_app
from tidal.app.server_state import ServerSettings, ServerState
from tidal.core.async_engine import AsyncEngine
from tidal.core.config import EngineConfig
from tidal.core.llm import LLM
from tidal.core.sampling_params import SamplingParams


def test_priority_is_refused_by_name_unless_the_server_schedules_by_it(
        state: ServerState) -> None:  # noqa: F811
    body = {"model": "tiny", "prompt": "hi", "priority": 3}
    with pytest.raises(ApiError) as info:
        prepare_completion_request(body, state)
    assert info.value.status == 400 and info.value.param == "priority"
    assert "--scheduling-policy priority" in info.value.message
    for bad in ("high", 1.5, 1 << 40):
        with pytest.raises(ApiError) as info:
            prepare_chat_request({"model": "tiny", "messages": CHAT, "priority": bad}, state)
        assert info.value.param == "priority"
    assert prepare_completion_request({"model": "tiny", "prompt": "hi", "priority": 0},
                                      state).priority == 0


def test_priority_reaches_the_prepared_request_on_a_priority_server(
        state: ServerState) -> None:  # noqa: F811
    state.settings = dataclasses.replace(state.settings, scheduling_policy="priority")
    assert prepare_completion_request({"model": "tiny", "prompt": "hi", "priority": -2},
                                      state).priority == -2
    assert prepare_chat_request({"model": "tiny", "messages": CHAT, "priority": 7},
                                state).priority == 7


def test_offline_priorities_need_the_policy_and_one_per_prompt(
        model_dir: Path) -> None:  # noqa: F811
    params = SamplingParams(max_tokens=2)
    fcfs = LLM(str(model_dir), kv_cache_memory=4 << 20)
    with pytest.raises(ValueError, match="scheduling policy"):
        fcfs.generate([[5, 6], [7, 8]], params, use_tqdm=False, priority=[0, 1])
    ranked = LLM(str(model_dir), kv_cache_memory=4 << 20, scheduling_policy="priority",
                 max_num_seqs=1)
    with pytest.raises(ValueError, match="priorities for 2 prompts"):
        ranked.generate([[5, 6], [7, 8]], params, use_tqdm=False, priority=[0])
    outs = ranked.generate([[5, 6], [7, 8]], params, use_tqdm=False, priority=[1, 0])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]


def test_a_high_priority_request_overtakes_a_running_stream(
        model_dir: Path) -> None:  # noqa: F811
    """One slot: a low-priority stream of 400 tokens is running when a priority -1 request
    comes; that one finishes while the stream still runs (it was preempted, then resumed)."""
    config = EngineConfig(model=str(model_dir), kv_cache_memory=4 << 20, max_num_seqs=1,
                          scheduling_policy="priority")
    engine = AsyncEngine(config)
    app = build_app(engine, ServerSettings(served_model_name="tiny",
                                           scheduling_policy="priority"))
    low = {"model": "tiny", "prompt": "once upon a time", "max_tokens": 400, "ignore_eos": True,
           "stream": True, "priority": 5}
    high = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "priority": -1}
    started, done = threading.Event(), {}
    with TestClient(app) as client:
        def stream_low() -> None:
            with client.stream("POST", "/v1/completions", json=low) as resp:
                for line in resp.iter_lines():
                    started.set()
                    if line == "data: [DONE]":
                        done["low"] = len(done)

        thread = threading.Thread(target=stream_low)
        thread.start()
        assert started.wait(60)
        answer = client.post("/v1/completions", json=high)
        done.setdefault("high", len(done))
        thread.join(120)
        assert answer.status_code == 200
        assert answer.json()["choices"][0]["finish_reason"] == "length"
        assert done == {"high": 0, "low": 1}, "the stream finished before the urgent request"
        assert engine.core.scheduler.num_preemptions >= 1
        metrics = client.get("/metrics").text
        assert 'tidal:preemptions_by_reason_total{reason="priority"} 1.0' in metrics
        assert 'tidal:preemptions_by_reason_total{reason="kv_cache"} 0.0' in metrics
