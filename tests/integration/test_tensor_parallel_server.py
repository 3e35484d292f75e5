"""A real server over two tensor-parallel CPU workers: it serves the tokens one process gives,
to the ``openai`` client and to ``curl``; and when a worker is killed mid-generation the stream
ends with an error event and ``[DONE]``, ``/health`` turns 503, the server exits non-zero and
no process of it is left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from bench.processes import ROOT, free_port
from tests.live_server import build_chat_model, curl, running_server, sse_events
from tidal.core import LLM, SamplingParams

pytestmark = [pytest.mark.integration, pytest.mark.slow]
PROMPTS = [[5, 17, 33, 60, 7, 99], [120, 4, 250, 31]]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("tp") / "tiny")


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def _workers(pid: int) -> list[int]:
    return [c for c in _children(pid)
            if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"


def _health(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_serves_the_tokens_of_one_process(model):
    with running_server(model, "--tensor-parallel-size", "2") as srv:
        assert len(_workers(srv.proc.pid)) == 2
        assert_serves_one_process_tokens(srv, model)


def assert_serves_one_process_tokens(srv: Any, model: Path) -> None:
    """The ``openai`` client and ``curl -N`` get the greedy tokens one process gives."""
    llm = LLM(str(model), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    got = client.completions.create(model=str(model), prompt=PROMPTS, max_tokens=16,
                                    temperature=0.0, extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == want
    body = json.dumps({"model": str(model), "prompt": PROMPTS[0], "max_tokens": 16,
                       "temperature": 0, "ignore_eos": True, "stream": True})
    events = sse_events(curl("-H", "Content-Type: application/json", "-d", body,
                             srv.url + "/v1/completions"))
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == want[0]


def _stream(url: str, model: Path, out: list[bytes]) -> None:
    body = json.dumps({"model": str(model), "prompt": "To be", "max_tokens": 1900,
                       "ignore_eos": True, "stream": True})
    out.append(curl("-H", "Content-Type: application/json", "-d", body,
                    url + "/v1/completions", timeout=120))


def test_a_killed_worker_ends_streams_with_an_error_and_the_server(model):
    with running_server(model, "--tensor-parallel-size", "2") as srv:
        workers = _workers(srv.proc.pid)
        assert len(workers) == 2
        assert_a_killed_worker_fails_loudly(srv, model, workers[1])


def _wait_for_tokens(url: str, tokens: float, limit_s: float = 60.0) -> None:
    """Until the server's ``/metrics`` count ``tokens`` generated since it started."""
    deadline = time.monotonic() + limit_s
    while _generated(url) < tokens:
        assert time.monotonic() < deadline, "no tokens were generated"
        time.sleep(0.1)


def _generated(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines
               if line.startswith("tidal:generation_tokens_total"))


def assert_a_killed_worker_fails_loudly(srv: Any, model: Path, worker: int) -> None:
    """``worker`` killed mid-stream: the stream ends with an error event and ``[DONE]``,
    ``/health`` turns 503 within 2 s, the server exits non-zero and leaves no process."""
    children = _children(srv.proc.pid)  # the workers and multiprocessing's helpers
    before = _generated(srv.url)
    out: list[bytes] = []
    reader = threading.Thread(target=_stream, args=(srv.url, model, out))
    reader.start()
    _wait_for_tokens(srv.url, before + 16)  # the stream is under way
    assert reader.is_alive(), f"the stream ended early: {out}"
    os.kill(worker, signal.SIGKILL)
    killed = time.monotonic()
    while _health(srv.url) != 503:
        assert time.monotonic() - killed < 2.0, "/health did not turn 503 within 2 s"
        time.sleep(0.05)
    reader.join(30)
    events = sse_events(out[0])
    assert events[-1] == b"[DONE]"
    assert "error" in events[-2], events[-2]
    assert any(e["choices"] for e in events[:-2] if "choices" in e), "no token came first"
    assert srv.proc.wait(30) != 0, "the server should exit non-zero"
    time.sleep(0.5)
    assert not [p for p in children if _alive(p)], "a process outlived its server"


def test_two_nodes_on_loopback_serve_the_tokens_of_one_process(model):
    """Node 1 runs only its worker (``--node-rank 1``); node 0 serves, its rank 0 meeting
    node 1's rank 1 at the rendezvous address."""
    llm = LLM(str(model), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].text
    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    nodes = ["--tensor-parallel-size", "2", "--nnodes", "2", "--distributed-init-method",
             rendezvous]
    second = subprocess.Popen([sys.executable, "-m", "tidal", "serve", "--model", str(model),
                               *nodes, "--node-rank", "1"], cwd=ROOT)
    try:
        with running_server(model, *nodes, "--node-rank", "0") as srv:
            resp = httpx.post(srv.url + "/v1/completions", timeout=60, json={
                "model": str(model), "prompt": PROMPTS[0], "max_tokens": 16,
                "temperature": 0, "ignore_eos": True})
            assert resp.json()["choices"][0]["text"] == want
        assert second.wait(30) == 0, "node 1 should end cleanly with the head"
    finally:
        if second.poll() is None:
            second.kill()
