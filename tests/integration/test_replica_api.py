"""What routers ask a replica: ``/get_server_info``, ``/get_model_info``, ``/load``,
``/get_load``, ``/health`` and ``/flush_cache``, and the prefix-cache reset under the last one
(idle blocks lose their prefixes, blocks of running requests keep theirs, none leaks)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from bench.processes import ROOT, free_port
from bench.server_metrics import parse_metrics
from tidal.app.loading import LoadingGate
from tidal.app.routes import build_app
from tidal.app.server_state import ServerSettings
from tidal.core.async_engine import AsyncEngine
from tidal.core.block_pool import BlockPool
from tidal.core.config import EngineConfig
from tidal.core.engine_core import EngineCore
from tidal.core.kv_cache_manager import KVCacheManager
from tidal.core.request import Request
from tidal.core.sampling_params import SamplingParams

HITS = "tidal:prefix_cache_hits_total"
QUERIES = "tidal:prefix_cache_queries_total"
PROMPT = list(range(3, 60))  # three full blocks of 16 and a partial one


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tidal.gpu.random_model import build_model_dir

    return build_model_dir(tmp_path_factory.mktemp("replica") / "tiny", "llama")


def _config(model_dir: Path) -> EngineConfig:
    return EngineConfig(model=str(model_dir), kv_cache_memory=4 << 20, max_num_seqs=8)


# -- the block pool and the KV cache manager --------------------------------------------------
def test_reset_forgets_idle_blocks_and_keeps_held_ones() -> None:
    pool = BlockPool(4, enable_caching=True)
    held, idle = pool.get_new_blocks(2), pool.get_new_blocks(2)
    for i, block in enumerate(held + idle):
        pool.cache_block(block, bytes([i]))
    pool.free_blocks(idle)
    assert pool.reset_prefix_cache() is False  # the held blocks keep their entries
    assert [pool.get_cached_block(bytes([i])) for i in range(4)] == [*held, None, None]
    assert all(b.block_hash is None for b in idle) and pool.num_free_blocks == 2
    pool.free_blocks(held)
    assert pool.reset_prefix_cache() is True
    assert not pool.cached and pool.num_free_blocks == 4
    assert all(b.ref_cnt == 0 and b.block_hash is None for b in pool.blocks)


def test_a_repeated_prompt_misses_after_the_reset() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first = Request("a", list(range(12)), SamplingParams(max_tokens=4))
    kv.allocate_slots(first, 12)
    kv.free(first)
    again = Request("b", list(range(12)), SamplingParams(max_tokens=4))
    assert kv.get_computed_blocks(again)[1] == 8
    assert kv.reset_prefix_cache() is True
    after = Request("c", list(range(12)), SamplingParams(max_tokens=4))
    assert kv.get_computed_blocks(after) == ([], 0)
    assert kv.pool.num_free_blocks == 8


def test_reset_between_steps_leaves_running_requests_whole(model_dir: Path) -> None:
    """A request running when the cache is reset keeps its blocks and finishes with the
    tokens it would have had; afterwards every block is free and none is cached."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def run(reset_at: int | None) -> tuple[list[int], EngineCore]:
        core = EngineCore(_config(model_dir))
        core.add_request("warm", PROMPT, SamplingParams(max_tokens=1))
        while core.has_unfinished_requests():
            core.step()
        core.add_request("r", PROMPT, params)
        tokens, steps = [], 0
        while core.has_unfinished_requests():
            for out in core.step():
                tokens += out.outputs[0].token_ids
            steps += 1
            if steps == reset_at:
                held = core.kv.req_blocks["r"]
                assert core.reset_prefix_cache() is False
                assert all(b.ref_cnt == 1 for b in held)
                assert all(b.block_hash is not None for b in held[:3])
        return tokens, core

    plain, _ = run(None)
    tokens, core = run(3)
    assert tokens == plain and len(tokens) == 12
    assert core.kv.pool.num_free_blocks == core.kv.num_blocks
    assert core.reset_prefix_cache() is True and not core.kv.pool.cached


# -- the endpoints ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(model_dir: Path) -> Iterator[TestClient]:
    engine = AsyncEngine(_config(model_dir))
    app = build_app(engine, ServerSettings(served_model_name="tiny",
                                           model_path=str(model_dir)))
    with TestClient(app) as client:
        yield client


def _prefix_counters(client: TestClient) -> tuple[float, float]:
    values = parse_metrics(client.get("/metrics").text)
    return values[HITS], values[QUERIES]


def _complete(client: TestClient) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    assert client.post("/v1/completions", json=body).status_code == 200


def test_flush_cache_makes_a_repeated_prompt_miss(client: TestClient) -> None:
    _complete(client)
    hits, queries = _prefix_counters(client)
    _complete(client)
    hits_again, queries_again = _prefix_counters(client)
    assert queries_again > queries and hits_again - hits == 48  # three full blocks hit
    # sglang-router posts; a GET, which any web page can make a browser send, changes nothing
    assert client.get("/flush_cache").status_code == 405
    for method in ("POST", "POST"):
        flushed = client.request(method, "/flush_cache")
        assert flushed.status_code == 200 and flushed.json()["flushed"] is True
        _complete(client)
        hits_after, queries_after = _prefix_counters(client)
        assert queries_after > queries_again and hits_after == hits_again
        hits_again, queries_again = hits_after, queries_after
    assert parse_metrics(client.get("/metrics").text)["tidal:kv_cache_used_blocks"] == 0


def test_server_info_has_what_sglang_router_reads(client: TestClient, model_dir: Path) -> None:
    for path in ("/get_server_info", "/server_info"):
        info = client.get(path).json()
        assert info["model_path"] == str(model_dir) and info["model_id"] == "tiny"
        assert info["dp_size"] == 1 and info["is_generation"] is True
        assert info["version"] and info["max_model_len"] == 512
        assert info["max_total_num_tokens"] > 0 and info["max_running_requests"] == 8
        config = info["engine_config"]
        assert config["model"] == str(model_dir) and config["enable_prefix_caching"] is True
        assert config["max_num_seqs"] == 8 and config["block_size"] == info["page_size"]
        assert info["kernels"]  # what runs the model's ops now, as the banner says


def test_model_info(client: TestClient, model_dir: Path) -> None:
    for path in ("/get_model_info", "/model_info"):
        info = client.get(path).json()
        assert info["model_path"] == info["tokenizer_path"] == str(model_dir)
        assert info["is_generation"] is True and info["architectures"] == ["LlamaForCausalLM"]


def test_load_counts_running_and_waiting_requests(client: TestClient,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    assert client.get("/load").json() == {"server_load": 0}
    assert client.get("/get_load").json() == [
        {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    core = client.app.state.tidal.engine.core  # type: ignore[attr-defined]
    step = core.step

    def slow_step(*args: Any, **kwargs: Any) -> Any:  # the request must outlast the probes
        time.sleep(0.02)
        return step(*args, **kwargs)

    monkeypatch.setattr(core, "step", slow_step)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 100, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # it runs now
        assert client.get("/load").json() == {"server_load": 1}
        (rank,) = client.get("/get_load").json()
        assert rank["num_reqs"] == 1 and rank["num_tokens"] >= len(PROMPT)
        flushed = client.post("/flush_cache").json()
        assert flushed["flushed"] is False  # the running request keeps its blocks' prefixes
        assert [line for line in lines if line][-1] == "data: [DONE]"


def test_router_endpoints_take_the_api_key(model_dir: Path) -> None:
    app = build_app(AsyncEngine(_config(model_dir)),
                    ServerSettings(served_model_name="tiny", model_path=str(model_dir),
                                   api_key="sesame"))
    with TestClient(app) as client:
        for method, path in (("POST", "/flush_cache"), ("GET", "/get_server_info"),
                             ("GET", "/get_model_info"), ("GET", "/load"), ("GET", "/get_load"),
                             ("GET", "/metrics")):
            refused = client.request(method, path)
            assert refused.status_code == 401
            assert refused.json()["error"]["code"] == "invalid_api_key"
            auth = {"Authorization": "Bearer sesame"}
            assert client.request(method, path, headers=auth).status_code == 200
        assert client.get("/health").status_code == 200


def test_a_dead_engine_fails_health_and_flush_with_openai_errors(model_dir: Path) -> None:
    engine = AsyncEngine(_config(model_dir))
    app = build_app(engine, ServerSettings(served_model_name="tiny"))
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.get("/health").status_code == 200

        def crash() -> bool:
            raise RuntimeError("device lost")

        engine.core.reset_prefix_cache = crash  # type: ignore[method-assign]
        failed = client.post("/flush_cache")  # an error in the call reaches the caller only
        assert failed.status_code == 500 and "device lost" in failed.json()["error"]["message"]
        assert client.get("/health").status_code == 200
    for path in ("/health", "/flush_cache"):  # the lifespan stopped the engine
        dead = TestClient(app).request("POST" if path == "/flush_cache" else "GET", path)
        assert dead.status_code == 503 and dead.json()["error"]["code"] == "engine_dead"


# -- /health while the model loads ------------------------------------------------------------
def test_the_gate_answers_503_until_the_engine_is_up(model_dir: Path) -> None:
    gate = LoadingGate()
    with TestClient(gate) as client:
        for method, path in (("GET", "/health"), ("GET", "/v1/models"),
                             ("POST", "/v1/completions")):
            loading = client.request(method, path)
            assert loading.status_code == 503 and loading.headers["retry-after"] == "1"
            assert loading.json()["error"]["code"] == "model_loading"
        with pytest.raises(WebSocketDisconnect) as closed, \
                client.websocket_connect("/v1/chat/ws") as ws:
            ws.receive_json()
        assert closed.value.code == 1013
        engine = AsyncEngine(_config(model_dir))
        client.portal.call(gate.open, build_app(engine, ServerSettings(  # type: ignore[union-attr]
            served_model_name="tiny")))
        assert client.get("/health").json() == {"status": "ok"}
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    assert not engine.is_alive  # the gate's shutdown ended the app's lifespan


def test_a_model_that_fails_to_load_exits_non_zero(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"]}')
    done = subprocess.run([sys.executable, "-m", "tidal", "serve", "--model", str(broken),
                           "--port", str(free_port())], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1 and "the model failed to load" in done.stderr, done.stderr
