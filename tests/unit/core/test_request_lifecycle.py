"""Where each request spends its time: the engine's lifecycle stamps against the requests' own
timings under a workload that preempts, the phase histograms, the trace log line and the
OpenTelemetry spans, and timeouts (streamed or not, waiting or running, blocks back in the
pool, a bad ``timeout`` refused)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tidal.app.chat_template import ChatTemplate
from tidal.app.errors import ApiError
from tidal.app.metrics import ServerMetrics
from tidal.app.prepare import prepare_chat_request
from tidal.app.routes import build_app
from tidal.app.server_state import ServerSettings, ServerState
from tidal.core.async_engine import AsyncEngine
from tidal.core.config import EngineConfig
from tidal.core.lifecycle import Arrival, RequestStats
from tidal.core.sampling_params import SamplingParams

MODEL = "tiny"
CHAT = [{"role": "user", "content": "Tell me a joke"}]
BLOCK_BYTES = 8 << 10  # the tiny Llama's KV cache: 2 layers x K, V x 2 heads x 16 x fp32 x 16
EVENT = re.compile(rb"data: ([^\n]+)\n\n")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tidal.gpu.random_model import build_model_dir

    return build_model_dir(tmp_path_factory.mktemp("lifecycle") / "tiny", "llama")


def _engine(model_dir: Path, num_blocks: int = 64, max_num_seqs: int = 16,
            step_sleep: float = 0.0) -> tuple[AsyncEngine, list[float]]:
    """An engine on the tiny model whose steps take at least ``step_sleep`` seconds (so that
    timings are about steps, not the host's noise); the list gets each step's duration."""
    engine = AsyncEngine(EngineConfig(model=str(model_dir), kv_cache_memory=num_blocks *
                                      BLOCK_BYTES, max_num_seqs=max_num_seqs))
    assert engine.stats.num_total_blocks == num_blocks
    durations: list[float] = []
    step = engine.core.step

    def timed_step(*args: Any, **kwargs: Any) -> list:
        start = time.monotonic()
        time.sleep(step_sleep)
        try:
            return step(*args, **kwargs)
        finally:
            durations.append(time.monotonic() - start)

    engine.core.step = timed_step  # type: ignore[method-assign]
    return engine, durations


# -- phases under a workload that preempts ---------------------------------------------------
class _Timed:
    """One request as its client sees it: sent, first token, end."""

    def __init__(self) -> None:
        self.sent = time.monotonic()
        self.first: float | None = None
        self.end: float | None = None
        self.tokens = 0

    async def run(self, stream: AsyncIterator[Any]) -> None:
        async for out in stream:
            now = time.monotonic()
            n = sum(len(c.token_ids) for c in out.outputs)
            if n and self.first is None:
                self.first = now
            self.tokens += n
            if out.finished:
                self.end = now


def _histogram(metrics: ServerMetrics, name: str, suffix: str) -> float:
    value = metrics.registry.get_sample_value(f"tidal:{name}_{suffix}", {"model_name": MODEL})
    return 0.0 if value is None else value


async def test_phase_histograms_agree_with_the_requests_own_timings(
        model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Short requests decode while a long prompt arrives, in a KV cache of 8 blocks that
    cannot hold them all: requests are preempted and resumed. Each request's queue + prefill
    is its time to first token, and queue + inference its whole time, as its client measured
    them, within the steps that deliver outputs; the histograms hold every request, and the
    preemptions per request add up to the engine's count; the first preemption is logged."""
    caplog.set_level(logging.WARNING, logger="tidal.core.scheduler")
    engine, durations = _engine(model_dir, num_blocks=8, step_sleep=0.005)
    metrics = ServerMetrics(model_name=MODEL)
    finished: list[RequestStats] = []
    engine.finished_listeners += [metrics.observe_finished, finished.append]
    engine.start()
    try:
        greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=40)
        shorts = [_Timed() for _ in range(3)]
        tasks = [asyncio.create_task(t.run(engine.generate(
            [10 + i + 3 * j for j in range(8)], greedy, f"short-{i}",
            arrival=Arrival(t.sent, t.sent)))) for i, t in enumerate(shorts)]
        while not all(t.first for t in shorts):  # the shorts decode...
            await asyncio.sleep(0.001)
        long = _Timed()  # ... when a long prompt arrives
        tasks.append(asyncio.create_task(long.run(engine.generate(
            list(range(100, 200)), greedy.clone(max_tokens=8), "long",
            arrival=Arrival(long.sent, long.sent)))))
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        stats = engine.stats
    finally:
        await engine.shutdown()

    timed = {f"short-{i}": t for i, t in enumerate(shorts)} | {"long": long}
    by_id = {s.request_id: s for s in finished}
    assert sorted(by_id) == sorted(timed)
    assert stats.num_preemptions > 0, "the workload was meant to preempt"
    assert sum(s.num_preemptions for s in finished) == stats.num_preemptions
    warnings = [r.getMessage() for r in caplog.records if r.name == "tidal.core.scheduler"]
    assert len(warnings) == 1  # rate-limited: the first of several, within seconds
    assert re.fullmatch(r"Request (short-\d|long) preempted\. KV blocks freed\.", warnings[0])
    # a step delivers the previous step's outputs: allow two, and the event loop's wake-up
    slack = 2 * max(durations) + 0.05
    for rid, client in timed.items():
        s = by_id[rid]
        names = [name for name, _ in s.phases()]
        assert names.count("preempted") == names.count("resumed") == s.num_preemptions
        assert s.finish_reason == "length" and s.num_generation_tokens == client.tokens
        assert client.first is not None and client.end is not None
        ttft = client.first - client.sent
        engine_ttft = s.times.queued - s.times.arrival + s.queue_time + s.prefill_time
        assert engine_ttft <= ttft + 0.005 and ttft - engine_ttft <= slack, (rid, s)
        e2e = client.end - client.sent
        engine_e2e = s.times.queued - s.times.arrival + s.queue_time + s.inference_time
        assert engine_e2e <= e2e + 0.005 and e2e - engine_e2e <= slack, (rid, s)
        assert s.inference_time == pytest.approx(s.prefill_time + s.decode_time)
        assert s.times.num_steps >= s.num_generation_tokens
    n = len(timed)
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds", "request_preemptions"):
        assert _histogram(metrics, name, "count") == n, name
    assert _histogram(metrics, "request_preemptions", "sum") == stats.num_preemptions
    assert _histogram(metrics, "request_generation_tokens", "sum") == 3 * 40 + 8
    assert _histogram(metrics, "request_prompt_tokens", "sum") == 3 * 8 + 100
    client_ttft = sum(t.first - t.sent for t in timed.values())  # type: ignore[operator]
    to_queue = sum(s.times.queued - s.times.arrival for s in finished)
    engine_ttft = (to_queue + _histogram(metrics, "request_queue_time_seconds", "sum")
                   + _histogram(metrics, "request_prefill_time_seconds", "sum"))
    assert 0 <= client_ttft - engine_ttft <= n * slack
    client_e2e = sum(t.end - t.sent for t in timed.values())  # type: ignore[operator]
    engine_e2e = (to_queue + _histogram(metrics, "request_queue_time_seconds", "sum")
                  + _histogram(metrics, "request_inference_time_seconds", "sum"))
    assert 0 <= client_e2e - engine_e2e <= n * slack
    tpot = _histogram(metrics, "request_time_per_output_token_seconds", "sum")
    assert tpot == pytest.approx(sum(s.decode_time / (s.num_generation_tokens - 1)
                                     for s in finished))


def test_rate_limited_warning_counts_what_it_held_back(caplog: pytest.LogCaptureFixture
                                                       ) -> None:
    from tidal.core.lifecycle import RateLimitedWarning

    log = logging.getLogger("test.rate_limited")
    caplog.set_level(logging.WARNING, logger=log.name)
    warning = RateLimitedWarning(log, interval=0.2)
    for i in range(3):
        warning.warn("Request %s preempted.", i)
    time.sleep(0.25)
    warning.warn("Request %s preempted.", 3)
    assert [r.getMessage() for r in caplog.records] == [
        "Request 0 preempted.", "Request 3 preempted. (2 more since the last warning)"]


# -- the trace log line and the spans, through the server -----------------------------------
async def _client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                             timeout=120)


async def _serve(model_dir: Path, settings: ServerSettings, tracer: Any = None,
                 **engine_kwargs: Any) -> tuple[AsyncEngine, Any, list[float]]:
    engine, durations = _engine(model_dir, **engine_kwargs)
    app = build_app(engine, settings, tracer)
    engine.start()  # the lifespan's work: httpx's ASGI transport does not run it
    return engine, app, durations


PHASE_ORDER = ["arrival", "tokenized", "queued", "scheduled", "first_token", "last_token",
               "finished"]


async def test_trace_line_per_request_and_spans(model_dir: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    settings = ServerSettings(served_model_name=MODEL, enable_request_tracing=True)
    engine, app, _ = await _serve(model_dir, settings, provider.get_tracer("test"))
    caplog.set_level(logging.INFO, logger="tidal.trace")
    try:
        async with await _client(app) as client:
            bodies = [{"model": MODEL, "messages": CHAT, "max_tokens": 6, "ignore_eos": True,
                       "n": 2},
                      {"model": MODEL, "prompt": "once upon", "max_tokens": 5, "stream": True,
                       "ignore_eos": True}]
            chat, text = await asyncio.gather(
                client.post("/v1/chat/completions", json=bodies[0]),
                client.post("/v1/completions", json=bodies[1]))
            assert chat.status_code == text.status_code == 200
    finally:
        await engine.shutdown()

    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "tidal.trace"]
    assert len(lines) == 3  # a line per engine request: the chat's two choices, the text's
    for line in lines:
        assert [name for name, _ in line["phases"]] == PHASE_ORDER
        offsets = [ms for _, ms in line["phases"]]
        assert offsets == sorted(offsets) and offsets[0] == 0
        assert line["model"] == MODEL and line["finish_reason"] == "length"
        assert line["prompt_tokens"] > 0 and line["cached_tokens"] >= 0
        assert line["steps"] >= line["generation_tokens"] > 0 and line["preemptions"] == 0
        assert line["ms"]["queue"] >= 0 and line["ms"]["decode"] > 0
    chat_id, text_id = chat.json()["id"], _events(text.content)[0]["id"]
    assert sorted(line["request_id"] for line in lines) == sorted(
        [f"{chat_id}-0", f"{chat_id}-1", text_id])
    assert sorted(line["generation_tokens"] for line in lines) == [5, 6, 6]

    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.name == "llm_request"]
    assert len(roots) == 3
    for root in roots:
        children = sorted((s for s in spans if s.parent is not None
                           and s.parent.span_id == root.context.span_id),
                          key=lambda s: s.start_time)
        assert [s.name for s in children] == ["tokenize", "queue", "prefill", "decode"]
        assert root.start_time <= children[0].start_time
        assert all(a.end_time <= b.start_time + 1000 for a, b in zip(children, children[1:]))
        assert children[-1].end_time <= root.end_time
        attrs = root.attributes
        assert attrs["gen_ai.response.model"] == MODEL
        assert attrs["gen_ai.usage.completion_tokens"] in (5, 6)
        assert attrs["gen_ai.latency.time_to_first_token"] >= attrs[
            "gen_ai.latency.time_in_queue"]


# -- timeouts ---------------------------------------------------------------------------------
def _events(raw: bytes) -> list[Any]:
    assert EVENT.sub(b"", raw) == b"", raw
    return [e if e == b"[DONE]" else json.loads(e) for e in EVENT.findall(raw)]


async def _until(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


async def test_timeouts_abort_waiting_and_running_requests(model_dir: Path) -> None:
    """One sequence at a time, a step at least 5 ms: a request running longer than its
    timeout is aborted mid-reply, and requests queued behind it past theirs are aborted
    while waiting, streamed (an error event naming the timeout, then [DONE]) or not; every
    block is back in the pool and each counts as an abort."""
    settings = ServerSettings(served_model_name=MODEL)
    engine, app, _ = await _serve(model_dir, settings, max_num_seqs=1, step_sleep=0.005)
    try:
        async with await _client(app) as client:
            base = {"model": MODEL, "ignore_eos": True, "temperature": 0.0}
            running = asyncio.create_task(client.post("/v1/chat/completions", json={
                **base, "messages": CHAT, "max_tokens": 400, "timeout": 1.0}))
            await _until(lambda: engine.stats.num_running == 1, "the long request running")
            started = time.monotonic()
            streamed, waiting = await asyncio.gather(
                client.post("/v1/chat/completions", json={
                    **base, "messages": CHAT, "max_tokens": 4, "stream": True,
                    "timeout": 0.2}),
                client.post("/v1/completions", json={
                    **base, "prompt": "hello", "max_tokens": 4, "timeout": 0.2}))
            waited = time.monotonic() - started
            ran = await running
            await _until(lambda: engine.stats.num_running == engine.stats.num_waiting == 0,
                         "the engine going idle")
            stats = engine.stats
            scrape = (await client.get("/metrics")).text
    finally:
        await engine.shutdown()

    assert 0.2 <= waited < 0.9, "the queued requests ended at their timeout, not the long one's"
    assert ran.status_code == 200
    choice = ran.json()["choices"][0]
    assert choice["finish_reason"] == "abort"
    assert 0 < ran.json()["usage"]["completion_tokens"] < 400
    events = _events(streamed.content)
    assert events[-1] == b"[DONE]"
    error = events[-2]["error"]
    assert error["param"] == "timeout" and error["code"] == "request_timeout"
    assert "timeout of 0.2 s" in error["message"]
    assert [c["choices"][0]["finish_reason"] for c in events[:-2]][-1] == "abort"
    assert waiting.status_code == 200
    assert waiting.json()["choices"][0]["finish_reason"] == "abort"
    assert waiting.json()["choices"][0]["text"] == ""
    assert stats.num_free_blocks == stats.num_total_blocks
    assert 'tidal:request_success_total{finished_reason="abort"} 3.0' in scrape
    # the two that never ran reached no phase past the queue; the running one every one
    assert 'tidal:request_queue_time_seconds_count{model_name="tiny"} 1.0' in scrape
    assert 'tidal:request_generation_tokens_count{model_name="tiny"} 3.0' in scrape


class _NoEngine:
    is_alive = True


@pytest.fixture(scope="module")
def state(model_dir: Path) -> ServerState:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return ServerState(engine=_NoEngine(), tokenizer=tokenizer,  # type: ignore[arg-type]
                       settings=ServerSettings(served_model_name=MODEL, request_timeout=30.0),
                       metrics=ServerMetrics(), chat_template=ChatTemplate.for_tokenizer(
                           tokenizer), max_model_len=64, vocab_size=len(tokenizer),
                       kv_capacity_tokens=48, max_num_seqs=8)


@pytest.mark.parametrize("timeout", [0, -1, -0.5, "1", True, float("inf")])
def test_a_bad_timeout_is_refused_naming_the_field(state: ServerState, timeout: Any) -> None:
    with pytest.raises(ApiError) as err:
        prepare_chat_request({"model": MODEL, "messages": CHAT, "timeout": timeout}, state)
    assert err.value.status == 400 and err.value.param == "timeout"
    assert err.value.to_dict()["error"]["type"] == "invalid_request_error"


def test_the_servers_timeout_caps_the_requests(state: ServerState) -> None:
    def timeout(**fields: Any) -> float | None:
        return prepare_chat_request({"model": MODEL, "messages": CHAT, **fields}, state).timeout

    assert (timeout(), timeout(timeout=2.5), timeout(timeout=90)) == (30.0, 2.5, 30.0)
    state.settings.request_timeout = None
    try:
        assert (timeout(), timeout(timeout=90)) == (None, 90)
    finally:
        state.settings.request_timeout = 30.0


async def test_a_bad_timeout_is_a_400_over_http(model_dir: Path) -> None:
    engine, app, _ = await _serve(model_dir, ServerSettings(served_model_name=MODEL))
    try:
        async with await _client(app) as client:
            for path, body in (("/v1/chat/completions", {"messages": CHAT}),
                               ("/v1/completions", {"prompt": "hi"})):
                resp = await client.post(path, json={"model": MODEL, "timeout": 0, **body})
                assert resp.status_code == 400
                error = resp.json()["error"]
                assert error["param"] == "timeout" and "greater than 0" in error["message"]
    finally:
        await engine.shutdown()
