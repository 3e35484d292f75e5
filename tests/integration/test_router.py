"""Two replicas of ``python -m tidal serve`` behind the real sglang-router, started as the
README's "Several replicas behind a router" says (``cache_aware``): every request of a prefix
family (a long system prompt shared by short questions) lands on one replica, which then serves
the family from its prefix cache, as each replica's ``/metrics`` shows; a replica killed mid-run
costs only the streams it held, and the router sends later requests, of every family, to the
survivor."""

from __future__ import annotations

import random
import shlex
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from bench.processes import LaunchedServer, SglangRouter
from tests.integration.test_readme import BLOCKS, REPLICAS_SECTION, commands
from tests.live_server import DEVICE_ARGS, build_chat_model, metrics

pytest.importorskip("sglang_router", reason="sglang-router is not installed (the dev extra)")
pytestmark = [pytest.mark.integration, pytest.mark.slow]

FAMILIES = ("Ariel", "Banquo", "Cordelia", "Duncan")
WORDS = ("storm", "crown", "dagger", "island", "letter", "ghost", "heath", "king", "sea",
         "witch", "night", "spirit", "daughter", "castle", "sleep", "blood", "fool", "moon")
QUERIES = "tidal:prefix_cache_queries_total"
HITS = "tidal:prefix_cache_hits_total"


def readme_setup() -> tuple[list[list[str]], list[str]]:
    """The README's replica set-up: each replica's ``python -m tidal serve`` arguments, and the
    router's (every ``launch_router`` flag but its workers and port), checking the router is
    pointed at the replicas."""
    lines = [line for b in BLOCKS if b.section == REPLICAS_SECTION for line in commands(b)]
    argvs = [shlex.split(part) for line in lines for part in line.split("&") if part.strip()]
    serves = [a[4:] for a in argvs if a[:4] == ["python", "-m", "tidal", "serve"]]
    (router,) = [a for a in argvs if a[:3] == ["python", "-m", "sglang_router.launch_router"]]
    assert len(serves) == 2 and len(argvs) == 3, lines
    urls, rest, args = [], [], iter(router[3:])
    for arg in args:
        if arg == "--worker-urls":
            urls = [next(args) for _ in serves]
        elif arg == "--port":
            next(args)
        else:
            rest.append(arg)
    ports = [serve[serve.index("--port") + 1] for serve in serves]
    assert urls == [f"http://127.0.0.1:{port}" for port in ports], (urls, ports)
    return [[a for a in serve if a not in ("--port", port)] for serve, port in zip(serves, ports)
            ], rest


class Replica(LaunchedServer):
    """One replica: the README's serve arguments on a tiny chat model; the two share the
    host's cores, one thread each."""

    def env(self) -> dict[str, str]:
        return {**super().env(), "OMP_NUM_THREADS": "1"}


def system_prompt(name: str) -> str:
    rng = random.Random(name)
    rules = " ".join(f"{name} speaks of the {rng.choice(WORDS)} and the {rng.choice(WORDS)}."
                     for _ in range(20))
    return f"{name} answers every question. {rules}"


def chat(name: str, question: int, max_tokens: int, stream: bool = False) -> dict:
    return {"model": "tiny", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream,
            "messages": [{"role": "system", "content": system_prompt(name)},
                         {"role": "user", "content": f"Question {question}: who is there?"}]}


def counters(replicas: list[Replica]) -> list[tuple[float, float]]:
    """Each replica's prefix-cache (queries, hits), in prompt tokens."""
    return [(values[QUERIES], values[HITS]) for values in (metrics(r.url) for r in replicas)]


@dataclass
class Stream:
    """One streamed chat through the router, read on its own thread."""

    body: dict
    url: str
    started: threading.Event = field(default_factory=threading.Event)
    done: bool = False  # ended with a finish reason and [DONE]
    error: str | None = None
    ended: bool = False

    def start(self) -> Stream:
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        finished = False
        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json=self.body,
                              timeout=120) as resp:
                if resp.status_code != 200:
                    self.error = f"HTTP {resp.status_code}"
                    return
                for line in resp.iter_lines():
                    self.started.set()
                    if line == "data: [DONE]":
                        self.done = finished
                    elif line.startswith("data: ") and '"finish_reason":"length"' in line:
                        finished = True
        except httpx.HTTPError as exc:
            self.error = repr(exc)
        finally:
            self.started.set()
            self.ended = True

    def wait(self, timeout: float = 120) -> Stream:
        deadline = time.monotonic() + timeout
        while not self.ended:
            assert time.monotonic() < deadline, "a stream never ended"
            time.sleep(0.05)
        return self


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[SglangRouter, list[Replica]]]:
    serves, router_args = readme_setup()
    model = build_chat_model(tmp_path_factory.mktemp("router") / "tiny")
    args = [*DEVICE_ARGS, "--served-model-name", "tiny", "--kv-cache-memory", "32MiB"]
    replicas = [Replica(str(model), [*serve, *args]) for serve in serves]
    router = None
    try:
        for replica in replicas:
            replica.wait_ready(600)
        router = SglangRouter([r.url for r in replicas], router_args)
        router.wait_ready(300)
        yield router, replicas
    finally:
        for proc in (router, *replicas):
            if proc is not None:
                proc.stop()


def test_prefix_families_stay_on_one_replica_and_a_killed_one_costs_only_its_streams(
        cluster: tuple[SglangRouter, list[Replica]]) -> None:
    router, replicas = cluster
    # 1. Each family's first request, while the ones before still run: cache_aware sends a
    # prompt it has not seen to the replica with the fewest requests in flight.
    before = counters(replicas)
    first = []
    for name in FAMILIES:
        first.append(Stream(chat(name, 0, max_tokens=300, stream=True), router.url).start())
        assert first[-1].started.wait(120)
    assert all(s.wait().done for s in first), [s.error for s in first]
    placed = counters(replicas)
    assert all(p[0] > b[0] for p, b in zip(placed, before)), "a replica got no family"

    # 2. The rest of each family, one family at a time: all of it goes to one replica, whose
    # prefix cache already holds the family's system prompt from step 1.
    home: dict[str, int] = {}
    for name in FAMILIES:
        start = counters(replicas)
        for question in range(1, 6):
            resp = httpx.post(router.url + "/v1/chat/completions", json=chat(name, question, 4),
                              timeout=120)
            assert resp.status_code == 200, resp.text
        end = counters(replicas)
        served = [i for i in range(2) if end[i][0] > start[i][0]]
        assert len(served) == 1, f"{name} was split between the replicas: {start} -> {end}"
        (home[name],) = served
        queries = end[home[name]][0] - start[home[name]][0]
        hits = end[home[name]][1] - start[home[name]][1]
        assert hits / queries > 0.9, f"{name}: {hits} of {queries} prompt tokens hit"
    for (queries, hits) in counters(replicas):
        assert hits / queries > 0.7  # the whole run's hit rate, first requests included

    # 3. The router's /flush_cache reaches both replicas: a family's prompt misses at home.
    flushed = httpx.post(router.url + "/flush_cache", timeout=60)
    assert flushed.status_code == 200 and flushed.json()["workers_flushed"] == 2, flushed.text
    for name in FAMILIES:
        start = counters(replicas)
        resp = httpx.post(router.url + "/v1/chat/completions", json=chat(name, 1, 4),
                          timeout=120)
        assert resp.status_code == 200, resp.text
        end = counters(replicas)
        assert end[home[name]][0] > start[home[name]][0]
        assert [e[1] for e in end] == [s[1] for s in start], f"{name} hit after the flush"

    # 4. Two long streams per family; once all have started, the replica holding the first
    # family is killed. Its streams fail, the other replica's finish.
    streams = {name: [Stream(chat(name, q, max_tokens=1000, stream=True), router.url).start()
                      for q in (6, 7)] for name in FAMILIES}
    for stream in (s for group in streams.values() for s in group):
        assert stream.started.wait(120)
    victim = home[FAMILIES[0]]
    replicas[victim].proc.kill()
    for name, group in streams.items():
        for stream in group:
            stream.wait()
            if home[name] == victim:
                assert not stream.done, f"{name}'s stream outlived its replica"
            else:
                assert stream.done and stream.error is None, (name, stream.error)

    # 5. Once the router has seen the replica go, every family is served by the survivor.
    deadline = time.monotonic() + 30
    while router.healthy_workers() != 1:
        assert time.monotonic() < deadline, "the router never noticed the dead replica"
        time.sleep(0.2)
    survivor = replicas[1 - victim]
    start = metrics(survivor.url)[QUERIES]
    for name in FAMILIES:
        resp = httpx.post(router.url + "/v1/chat/completions", json=chat(name, 8, 4),
                          timeout=120)
        assert resp.status_code == 200, (name, resp.text)
    assert metrics(survivor.url)[QUERIES] > start
    assert survivor.proc.poll() is None
