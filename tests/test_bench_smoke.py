"""The benchmark harness's pieces on a tiny model: load generator, exact-length prompts,
request shapes for the peer, ratios and tables, plots, the step profiler and a whole
comparison run against tidal alone. No timing is asserted."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from transformers import AutoTokenizer

import bench.common
import bench.serving_comparison as harness
from bench.load_generator import (
    RequestClass,
    Workload,
    client_session,
    one_request,
    request_body,
    run_classes,
    run_workload,
)
from bench.plots import plot_all
from bench.processes import LAUNCH_ATTEMPTS, LaunchedServer
from bench.prompt_text import text_prompts, token_count
from bench.serving_report import markdown, ratios
from tests.live_server import running_server

OUT = 6  # output tokens per request
# Output tokens of the streams whose inter-token latencies are checked: a stream of a few tokens
# can finish before its handler first reads it (the tiny model decodes a token in well under a
# millisecond), and then all its tokens arrive merged into one event, leaving nothing to time.
TIMED_OUT = 32


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gpu.random_model import build_model_dir

    return build_model_dir(tmp_path_factory.mktemp("bench") / "tiny", "llama",
                           max_position_embeddings=1024)


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[LaunchedServer]:
    with running_server(tiny_model, "--kv-cache-memory", "8MiB") as srv:
        yield srv


def _check_report(report: dict[str, Any], requests: int, prompt_len: int | None,
                  itl_required: bool = True, out: int = OUT) -> None:
    """``itl_required=False`` for a lone stream whose deltas may all merge into one event
    (the server merges them when the client falls behind), leaving no interval to time."""
    assert report["failed"] == 0, report["errors"]
    assert report["completed"] == requests
    assert report["output_tokens_per_request"] == {"min": out, "max": out, "mean": out}
    if prompt_len is not None:
        assert report["prompt_tokens_mean"] == prompt_len
    assert report["ttft"]["median_ms"] > 0
    itl = report["itl"]
    assert itl is not None or not itl_required
    if itl is not None:
        assert itl["p99_ms"] >= itl["median_ms"] > 0
    assert report["e2e"]["median_ms"] >= report["ttft"]["median_ms"]
    assert report["output_token_throughput_per_s"] > 0


def test_load_generator_against_tidal(server: Any) -> None:
    work = Workload(input_len=12, output_len=TIMED_OUT, num_requests=2, concurrency=2)
    report = asyncio.run(run_workload(server.url, server.model, work, quantiles=True))
    _check_report(report, 2, 12, out=TIMED_OUT)
    assert len(report["quantiles_ms"]["itl"]) == 101
    assert report["server"]["process_cpu_s"] > 0  # read from tidal's /metrics


def test_load_generator_runs_its_workloads_on_uvloop(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture) -> None:
    """The client's own CPU per event comes out of the server under test on a small host."""
    import uvloop

    import bench.load_generator as lg

    loops = []

    async def recorded(url: str, model: str, work: Workload) -> dict[str, Any]:
        loops.append(type(asyncio.get_running_loop()))
        return {"concurrency": work.concurrency}

    monkeypatch.setattr(lg, "run_workload", recorded)
    lg.main(["--url", "http://127.0.0.1:9", "--model", "m", "--concurrency", "1", "2"])
    assert loops == [uvloop.Loop] * 3  # the warm-up and the two runs
    assert '"concurrency": 2' in capsys.readouterr().out


def test_text_prompts_and_classes_against_tidal(server: Any, tokenizer: Any) -> None:
    short = text_prompts(tokenizer, 3, 10, seed=1)
    long = text_prompts(tokenizer, 1, 300, seed=2)
    classes = {"short": RequestClass(Workload(10, TIMED_OUT, 3, concurrency=2), list(short)),
               "long": RequestClass(Workload(300, OUT, 1, concurrency=1), list(long))}
    report = asyncio.run(run_classes(server.url, server.model, classes))
    _check_report(report["classes"]["short"], 3, 10, out=TIMED_OUT)
    _check_report(report["classes"]["long"], 1, 300, itl_required=False)


def test_text_prompts_have_exact_lengths(tokenizer: Any) -> None:
    for length in (1, 9, 64):
        prompts = text_prompts(tokenizer, 4, length, seed=length)
        assert [token_count(tokenizer, p) for p in prompts] == [length] * 4
        assert len(set(prompts)) == 4
    prefix = text_prompts(tokenizer, 1, 20, seed=5)[0] + "\n"
    shared = text_prompts(tokenizer, 3, 32, seed=6, prefix=prefix)
    assert all(p.startswith(prefix) and token_count(tokenizer, p) == 32 for p in shared)


def test_transformers_flavor_request_and_stream() -> None:
    body = request_body("transformers", "m", "hi there", 5)
    assert "ignore_eos" not in body and "stream_options" not in body
    assert json.loads(body["generation_config"]) == {
        "max_new_tokens": 5, "eos_token_id": -1, "do_sample": False}
    with pytest.raises(ValueError):
        request_body("transformers", "m", [1, 2, 3], 5)
    assert request_body("tidal", "m", [1, 2], 5)["ignore_eos"] is True

    def chunk(text: str) -> str:
        return "data: " + json.dumps({"choices": [{"index": 0, "text": text}]}) + "\n\n"

    # transformers serve: usage rides on the last chunk beside a choice, and no [DONE]
    sse = chunk("a") + chunk("b") + chunk("c") + "data: " + json.dumps({
        "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 3}}) + "\n\n"
    seen: list[dict] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.Response(text=sse, content_type="text/event-stream")

    async def go(stream: str) -> Any:
        nonlocal sse
        sse = stream
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        async with TestServer(app) as server:
            async with client_session(str(server.make_url("")), 4) as client:
                return await one_request(client, "m", "hi", 3, flavor="transformers")

    result = asyncio.run(go(sse))
    assert result.ok and result.output_tokens == 3 and result.prompt_tokens == 2
    assert len(result.itl) == 2 and seen[0]["prompt"] == "hi"
    cut = asyncio.run(go(chunk("a")))  # ended with neither finish_reason nor [DONE]
    assert not cut.ok and cut.error
    failed = asyncio.run(go('data: {"error": "boom"}\n\n'))
    assert not failed.ok and failed.error == "boom"


def _fake_report(tok_s: float, ttft: float) -> dict[str, Any]:
    q = [ttft + i for i in range(101)]
    return {"classes": {"all": {
        "output_token_throughput_per_s": tok_s, "request_throughput_per_s": tok_s / 10,
        "ttft": {"median_ms": ttft, "p99_ms": 2 * ttft}, "itl": {"median_ms": 5, "p99_ms": 9},
        "e2e": {"median_ms": 100, "p99_ms": 200},
        "output_tokens_per_request": {"min": 10, "max": 10, "mean": 10},
        "quantiles_ms": {"ttft": q, "itl": q, "e2e": q}}}}


def test_ratios_table_and_plots(tmp_path: Path) -> None:
    args = harness.parse_args(["--quick"])
    scenarios = harness.plan(args)
    assert len({s.seed for s in scenarios}) == len(scenarios)
    result = {"setup": {"model": "m"}, "scenarios": [
        {**vars(s), "reports": {"tidal": _fake_report(400.0 * (i + 1), 50.0),
                                "transformers": _fake_report(100.0 * (i + 1), 200.0)}}
        for i, s in enumerate(scenarios) if not s.long_len]}
    r = ratios(result["scenarios"][0]["reports"]["tidal"]["classes"]["all"],
               result["scenarios"][0]["reports"]["transformers"]["classes"]["all"])
    assert r["output tok/s"] == pytest.approx(4.0)
    assert r["TTFT p50 ms"] == pytest.approx(0.25)
    text = markdown(result)
    assert "| c1-in32 | 4.00x | 4.00x | 0.25x" in text
    path = tmp_path / "cmp.json"
    path.write_text(json.dumps(result))
    for png in plot_all(path, tmp_path):
        assert png.read_bytes()[:4] == b"\x89PNG"


def test_every_round_has_prompts_of_its_own(tokenizer: Any) -> None:
    """Repeated prompts would hit tidal's prefix cache from the second round on: no two
    rounds of a workload share a first block (16 tokens) of any prompt."""
    args = harness.parse_args(["--quick", "--repeats", "3"])
    for scenario in harness.plan(args):
        heads = [{tuple(tokenizer(p)["input_ids"][:16]) for c in classes.values()
                  for p in c.prompts}
                 for classes in harness.rounds_of(scenario, tokenizer, args.repeats)]
        assert len(heads) == 3
        assert all(not (heads[i] & heads[j]) for i in range(3) for j in range(i + 1, 3))
    with pytest.raises(SystemExit):
        harness.parse_args(["--repeats", "0"])


def test_median_round_is_reported_with_every_rounds_figure() -> None:
    rounds = [_fake_report(tok_s, ttft) for tok_s, ttft in ((300, 1), (100, 2), (200, 3))]
    chosen = harness.median_round(rounds)
    assert chosen["classes"]["all"]["ttft"]["median_ms"] == 3  # the 200 tok/s round
    assert chosen["round_output_tok_per_s"] == [300, 100, 200]
    assert harness.median_round(rounds[:2])["classes"]["all"]["ttft"]["median_ms"] == 2
    assert "round_output_tok_per_s" not in harness.median_round(rounds[:1])
    result = {"scenarios": [{"name": "c32-in32", "reports": {"tidal": chosen}}]}
    assert "| c32-in32 | tidal | 300.0, 100.0, 200.0 |" in markdown(result)
    assert "## Rounds" not in markdown({"scenarios": [
        {"name": "c1-in32", "reports": {"tidal": rounds[0]}}]})


@pytest.mark.slow
def test_comparison_run_against_tidal_alone(tiny_model: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path)
    warm_ups = []

    def warm_up(server: Any, flavor: str, tokenizer: Any, requests: int, *args: Any) -> None:
        warm_ups.append((requests, *args[:1]))
        real_warm_up(server, flavor, tokenizer, requests, *args)

    real_warm_up = harness.warm_up
    monkeypatch.setattr(harness, "warm_up", warm_up)
    path = harness.main(["--quick", "--peer", "none", "--model", str(tiny_model),
                         "--long-len", "300", "--output-len", str(OUT), "--name", "smoke",
                         "--server-arg=--kv-cache-memory=8MiB", "--repeats", "2"])
    result = json.loads(path.read_text())
    names = [s["name"] for s in result["scenarios"]]
    assert names == ["c1-in32", "c4-in32", "shared-prefix", "mixed"]
    # the server's start, then each workload's concurrency and prompt length
    assert warm_ups == [(2,), (1, 32), (4, 32), (4, 96), (2, 32)]
    assert result["setup"]["scenario_warmup"] is True
    for scenario in result["scenarios"]:
        for cls in scenario["reports"]["tidal"]["classes"].values():
            assert cls["failed"] == 0 and cls["completed"] > 0
        assert len(scenario["reports"]["tidal"]["round_output_tok_per_s"]) == 2
    assert (tmp_path / "smoke.md").read_text().count("| tidal |") == 5 + 4  # 4 in Rounds
    assert (tmp_path / "smoke_throughput.png").is_file()


def test_profile_step_on_tiny_model(tiny_model: Path) -> None:
    from bench.profile_step import main

    profiles = main(["--model", str(tiny_model), "--batch-sizes", "1", "3", "--steps", "4",
                     "--input-len", "8", "--functions", "3", "--out", ""])
    assert [p.batch_size for p in profiles] == [1, 3]
    for p in profiles:
        assert p.steps == 4  # the window is marked on the engine thread: exact
        assert all(p.step_ms[phase] > 0 for phase in ("schedule", "forward", "sample", "post"))
        assert p.step_ms["total"] == pytest.approx(sum(v for k, v in p.step_ms.items()
                                                       if k != "total"))
        shares = [share for _, share in p.top_costs]
        assert shares == sorted(shares, reverse=True)
        assert 0 < p.overhead_share < 1
        assert len(p.functions) == 3


_HEALTH_SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


class _PortTakenFirst(LaunchedServer):
    """A stand-in server: its first ``taken`` processes find their port taken, the next serves
    /health; with ``other_failure`` the first exits for another reason."""

    def __init__(self, other_failure: bool = False, taken: int = 1) -> None:
        self.other_failure = other_failure
        self.taken = taken
        self.launched_ports: list[int] = []
        super().__init__("model", [])

    def command(self) -> list[str]:
        self.launched_ports.append(self.port)
        if len(self.launched_ports) <= self.taken:
            said = "out of memory" if self.other_failure else "[Errno 98] Address already in use"
            return [sys.executable, "-c", f"print('OSError: {said}'); raise SystemExit(1)"]
        return [sys.executable, "-c", _HEALTH_SERVER, str(self.port)]


def test_server_whose_port_was_taken_starts_again_on_another():
    server = _PortTakenFirst()
    try:
        server.wait_ready(timeout=60)
        first, second = server.launched_ports
        assert first != second and server.url.endswith(f":{second}")
    finally:
        server.stop()


def test_server_failing_otherwise_is_reported_with_its_log():
    server = _PortTakenFirst(other_failure=True)
    with pytest.raises(RuntimeError, match="out of memory"):
        server.wait_ready(timeout=60)
    assert len(server.launched_ports) == 1


def test_server_gives_up_after_its_launch_attempts_without_starting_another():
    server = _PortTakenFirst(taken=LAUNCH_ATTEMPTS + 1)
    try:
        with pytest.raises(RuntimeError, match="no free port"):
            server.wait_ready(timeout=60)
        assert len(server.launched_ports) == LAUNCH_ATTEMPTS
    finally:
        server.stop()
