"""How the server answers others while one client attacks it (docs/robustness.md). The target:
while any single client sends the worst request it can within the body cap, /health answers
within 100 ms and a normal completion within 2x its unloaded time.

Starts the embedded default model with the default flags (``bench.served_twins.EmbeddedServer``),
measures /health (polled at ~20 Hz) and a normal completion (a short greedy /v1/completions of
16 tokens, one after another) unloaded, then under each attack in turn, run continuously from
one client (127.0.0.1, one or a few connections) for ``--seconds``:

- ``prompts``: /v1/completions with as many one-character prompts as fit under the body cap;
- ``grammar``: 50,000-entry enums (refused by the size limits) on one connection, and on four
  (one per compile worker) json_schema patterns of nested repetitions (``([a-z]{0,80}){0,80}``,
  passing the size limits but compiling past the 15 s time limit), each request distinct;
- ``deep``: a JSON schema nested as deep as the body cap allows;
- ``flood``: streamed chats with n=128, retried at once when refused (429);
- ``chunked``: a chunked body that never ends, sent as fast as the socket takes it;
- ``slowloris``: a few bodies sent one byte a second.

The measuring client runs in a process of its own, from 127.0.0.2 (another client to the
server's fair share), so the attacker's event loop never delays it. The attacker, the measuring
client and the server share the host's cores: the attacker's and the server's CPU seconds are
recorded beside each attack. Writes ``bench/results/attack_latency.json``.

    python -m bench.attack_latency                      # every attack, 10 s each
    python -m bench.attack_latency --seconds 2 --attacks prompts chunked
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import statistics
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from bench.served_twins import EmbeddedServer
from bench.server_metrics import parse_metrics

ATTACKER = "127.0.0.1"
MEASURER = "127.0.0.2"  # another client to the server's fair share (by address)
BODY_CAP = 4 << 20  # the server's default --max-request-bytes
HEALTH_HZ = 20.0
HEALTH_WITHIN_MS = 100.0
COMPLETION_WITHIN_X = 2.0
PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?"
NORMAL = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
# a json_schema pattern that passes the size limits and compiles past the 15 s limit (as a
# structured_outputs regex it compiles at once)
SLOW_REGEX = "([a-z]{0,80}){0,80}"
CHAT = [{"role": "user", "content": "Tell me a long story"}]
CHUNK = b"10000\r\n" + b"x" * 0x10000 + b"\r\n"
# grammar last: a compile past its time limit runs on to its end on its thread (minutes for
# these patterns), keeping the cores busy after the attack stops
ATTACKS = ("prompts", "deep", "flood", "chunked", "slowloris", "grammar")
CONNECTIONS = {"prompts": 2, "grammar": 5, "deep": 2, "flood": 16, "chunked": 2,
               "slowloris": 4}
DESCRIPTIONS = {
    "prompts": "/v1/completions with as many 1-char prompts as fit under the body cap",
    "grammar": ("distinct 50,000-entry enums on one connection; distinct json_schema patterns "
                "^xN([a-z]{0,80}){0,80}$ on four (one per compile worker)"),
    "deep": "a json_schema nested as deep as fits under the body cap",
    "flood": "streamed chats with n=128, max_tokens 200, retried at once on 429",
    "chunked": "a chunked body that never ends, as fast as the socket takes it",
    "slowloris": "bodies of Content-Length 4 MiB sent one byte a second",
}


# -- the measuring client (a process of its own) -----------------------------------------------
def measure(url: str, model: str, seconds: float, min_polls: int = 0,
            min_completions: int = 0) -> dict[str, Any]:
    """Poll /health at HEALTH_HZ and send normal completions one after another, for
    ``seconds`` (and until ``min_polls`` polls and ``min_completions`` completions); the
    completion in flight at the end is waited for. Runs in the measuring process."""
    return asyncio.run(_measure(url, model, seconds, min_polls, min_completions))


async def _measure(url: str, model: str, seconds: float, min_polls: int,
                   min_completions: int) -> dict[str, Any]:
    health_ms: list[float] = []
    completion_s: list[float] = []
    errors: Counter[str] = Counter()
    end = time.monotonic() + seconds
    done = asyncio.Event()

    def enough() -> bool:
        return (time.monotonic() >= end and len(health_ms) >= min_polls
                and len(completion_s) >= min_completions)

    async def health() -> None:
        # a fresh connection each poll, as a prober opens one
        transport = httpx.AsyncHTTPTransport(local_address=MEASURER)
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(transport=transport, limits=limits, timeout=30) as client:
            while not done.is_set():
                start = time.perf_counter()
                try:
                    resp = await client.get(url + "/health")
                    took = time.perf_counter() - start
                    if resp.status_code == 200:
                        health_ms.append(1000 * took)
                    else:
                        errors[f"health {resp.status_code}"] += 1
                except httpx.HTTPError as exc:
                    took = time.perf_counter() - start
                    errors[f"health {type(exc).__name__}"] += 1
                await asyncio.sleep(max(0.0, 1 / HEALTH_HZ - took))

    async def completions() -> None:
        transport = httpx.AsyncHTTPTransport(local_address=MEASURER)
        async with httpx.AsyncClient(transport=transport, timeout=300) as client:
            while not enough():
                start = time.perf_counter()
                try:
                    resp = await client.post(url + "/v1/completions",
                                             json={"model": model, **NORMAL})
                    if resp.status_code == 200:
                        completion_s.append(time.perf_counter() - start)
                    else:
                        errors[f"completion {resp.status_code}"] += 1
                        await asyncio.sleep(0.05)
                except httpx.HTTPError as exc:
                    errors[f"completion {type(exc).__name__}"] += 1
            while len(health_ms) < min_polls:
                await asyncio.sleep(0.05)
            done.set()

    await asyncio.gather(health(), completions())
    return {"health_ms": health_ms, "completion_s": completion_s, "errors": dict(errors)}


# -- the attacks (the main process's event loop) -----------------------------------------------
class Attack:
    """One attack's connections until ``stop``, and what the server answered them. Once
    stopped, requests in flight get up to ``answer_wait_s`` to be answered (and counted)."""

    answer_wait_s = 30.0

    def __init__(self, url: str, port: int, model: str, connections: int) -> None:
        self.url, self.port, self.model = url, port, model
        self.connections = connections
        self.outcomes: Counter[str] = Counter()
        self.requests = 0
        self.bytes_sent = 0
        self.stop = asyncio.Event()
        self.serial = 0

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        transport = httpx.AsyncHTTPTransport(local_address=ATTACKER)
        limits = httpx.Limits(max_connections=self.connections)
        return httpx.AsyncClient(base_url=self.url, transport=transport, limits=limits,
                                 timeout=300, **kwargs)

    def next_serial(self) -> int:
        self.serial += 1
        return self.serial

    async def post_loop(self, client: httpx.AsyncClient, path: str,
                        body: Callable[[], bytes]) -> None:
        """POST ``body()`` to ``path`` again and again, as soon as each is answered."""
        headers = {"Content-Type": "application/json"}
        while not self.stop.is_set():
            content = body()
            self.requests += 1
            try:
                resp = await client.post(path, content=content, headers=headers)
                self.bytes_sent += len(content)
                self.outcomes[str(resp.status_code)] += 1
            except httpx.HTTPError as exc:
                self.outcomes[type(exc).__name__] += 1
                await asyncio.sleep(0.01)

    async def run(self) -> None:
        raise NotImplementedError


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


class Prompts(Attack):
    async def run(self) -> None:
        head = f'{{"model":{_json(self.model)},"max_tokens":1,"prompt":["a"'.encode()
        tail = b"]}"
        count = (BODY_CAP - 64 - len(head) - len(tail)) // 4 + 1
        body = head + b',"a"' * (count - 1) + tail
        assert len(body) <= BODY_CAP
        self.detail = {"prompts": count, "body_bytes": len(body)}
        async with self.client() as client:
            await asyncio.gather(*(self.post_loop(client, "/v1/completions", lambda: body)
                                   for _ in range(self.connections)))


class Grammar(Attack):
    ENUM = 50_000

    async def run(self) -> None:
        enum_head = _json([f"v{i}" for i in range(self.ENUM - 1)])[:-1].encode()
        self.detail = {"enum_entries": self.ENUM, "pattern": f"^xN{SLOW_REGEX}$"}

        def enum_body() -> bytes:  # distinct by its last entry
            schema = enum_head + f',"x{self.next_serial()}"]'.encode()
            return (f'{{"model":{_json(self.model)},"prompt":"a","max_tokens":8,'
                    f'"response_format":{{"type":"json_schema","json_schema":{{"name":"x",'
                    f'"schema":{{"enum":').encode() + schema + b"}}}}"

        def pattern_body() -> bytes:  # distinct by its literal prefix
            pattern = f"^x{self.next_serial()}{SLOW_REGEX}$"
            return _json({"model": self.model, "prompt": "a", "max_tokens": 8,
                          "response_format": {"type": "json_schema", "json_schema": {
                              "name": "x", "schema": {"type": "string",
                                                      "pattern": pattern}}}}).encode()

        async with self.client() as client:  # one connection of enums, the rest patterns
            await asyncio.gather(*(self.post_loop(client, "/v1/completions",
                                                  enum_body if i == 0 else pattern_body)
                                   for i in range(self.connections)))


class Deep(Attack):
    LEVEL = b'{"type":"object","properties":{"a":'

    async def run(self) -> None:
        head = (f'{{"model":{_json(self.model)},"prompt":"a","max_tokens":8,'
                f'"response_format":{{"type":"json_schema","json_schema":{{"name":"x",'
                f'"schema":').encode()
        tail = b"}}}"
        leaf = b'{"type":"string","description":"%d"}'
        room = BODY_CAP - 64 - len(head) - len(tail) - len(leaf) - 12
        levels = room // (len(self.LEVEL) + 2)
        opened, closed = head + self.LEVEL * levels, b"}}" * levels + tail
        self.detail = {"levels": levels, "body_bytes": len(opened) + len(closed) + len(leaf)}

        def body() -> bytes:  # distinct by its leaf's description
            return opened + leaf % self.next_serial() + closed

        async with self.client() as client:
            await asyncio.gather(*(self.post_loop(client, "/v1/completions", body)
                                   for _ in range(self.connections)))


class Flood(Attack):
    answer_wait_s = 0.0  # its outcomes count at the headers; its streams run long after

    async def run(self) -> None:
        body = {"model": self.model, "messages": CHAT, "n": 128, "max_tokens": 200,
                "stream": True, "ignore_eos": True}
        self.detail = {"n": 128, "max_tokens": 200}

        async def stream(client: httpx.AsyncClient) -> None:
            while not self.stop.is_set():
                self.requests += 1
                try:
                    async with client.stream("POST", "/v1/chat/completions",
                                             json=body) as resp:
                        self.outcomes[str(resp.status_code)] += 1
                        async for _ in resp.aiter_bytes():
                            pass
                except httpx.HTTPError as exc:
                    self.outcomes[type(exc).__name__] += 1
                    await asyncio.sleep(0.01)

        async with self.client() as client:
            await asyncio.gather(*(stream(client) for _ in range(self.connections)))


class RawAttack(Attack):
    """An attack on a raw socket: ``head`` sent, then ``feed`` until the server answers or
    closes; again on a new connection. Its bytes count as they are sent, and its bodies may
    never end, so a stop cuts it at once."""

    answer_wait_s = 0.0

    head = b""

    async def feed(self, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    async def one(self) -> None:
        while not self.stop.is_set():
            self.requests += 1
            try:
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", self.port, local_addr=(ATTACKER, 0))
            except OSError as exc:
                self.outcomes[type(exc).__name__] += 1
                await asyncio.sleep(0.05)
                continue
            feeder = asyncio.create_task(self._feed(writer))
            try:
                reply = await reader.read(4096)
                self.outcomes[reply[:12].decode(errors="replace").strip() or "closed"] += 1
            except OSError as exc:
                self.outcomes[type(exc).__name__] += 1
            finally:
                feeder.cancel()
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await feeder
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()

    async def _feed(self, writer: asyncio.StreamWriter) -> None:
        writer.write(self.head % self.port)
        self.bytes_sent += len(self.head)
        await writer.drain()
        await self.feed(writer)

    async def run(self) -> None:
        await asyncio.gather(*(self.one() for _ in range(self.connections)))


class Chunked(RawAttack):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")

    async def feed(self, writer: asyncio.StreamWriter) -> None:
        self.detail = {"chunk_bytes": len(CHUNK)}
        while True:
            writer.write(CHUNK)
            await writer.drain()
            self.bytes_sent += len(CHUNK)


class Slowloris(RawAttack):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
            b"Content-Type: application/json\r\nContent-Length: " + str(BODY_CAP).encode()
            + b"\r\n\r\n")

    async def feed(self, writer: asyncio.StreamWriter) -> None:
        self.detail = {"content_length": BODY_CAP, "bytes_per_second": 1}
        while True:
            writer.write(b" ")
            await writer.drain()
            self.bytes_sent += 1
            await asyncio.sleep(1.0)


KINDS: dict[str, type[Attack]] = {"prompts": Prompts, "grammar": Grammar, "deep": Deep,
                                  "flood": Flood, "chunked": Chunked, "slowloris": Slowloris}


# -- the server's state and CPU -----------------------------------------------------------------
def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        return parse_metrics(resp.read().decode())


def process_tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of ``pid`` and its descendants, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        parents[int(entry.name)] = int(fields[1])
        times[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        total += times.get(current, 0.0)
        todo += [child for child, parent in parents.items() if parent == current]
    return total


def settle(url: str, pid: int, timeout: float = 40.0) -> tuple[float, bool]:
    """Wait for the engine to go idle, every admission to be given back and the server's CPU
    to go quiet (a grammar compile past its time limit finishes on its thread); returns the
    seconds waited and whether it got there."""
    start = time.monotonic()
    quiet = 0
    while time.monotonic() - start < timeout:
        values = metrics(url)
        idle = (values.get("tidal:num_requests_running", 0) == 0
                and values.get("tidal:num_requests_waiting", 0) == 0
                and values.get("tidal:admitted_sequences", 0) == 0)
        before = process_tree_cpu(pid)
        time.sleep(0.5)
        busy = (process_tree_cpu(pid) - before) / 0.5
        quiet = quiet + 1 if idle and busy < 0.15 else 0
        if quiet >= 2:
            return time.monotonic() - start, True
    return time.monotonic() - start, False


# -- summaries ---------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(sample: dict[str, Any], unloaded_s: float | None = None) -> dict[str, Any]:
    health, completions = sample["health_ms"], sample["completion_s"]
    out: dict[str, Any] = {
        "health_ms": {"n": len(health), "p50": percentile(health, 0.5),
                      "p99": percentile(health, 0.99), "max": max(health, default=None)},
        "completion_s": {"n": len(completions),
                         "median": statistics.median(completions) if completions else None,
                         "max": max(completions, default=None),
                         "samples": [round(s, 4) for s in completions]},
        "errors": sample["errors"]}
    if unloaded_s and completions:
        out["completion_s"]["ratio_median"] = out["completion_s"]["median"] / unloaded_s
        out["completion_s"]["ratio_max"] = out["completion_s"]["max"] / unloaded_s
        out["health_within_target"] = (out["health_ms"]["max"] is not None
                                       and out["health_ms"]["max"] <= HEALTH_WITHIN_MS)
        out["completion_within_target"] = out["completion_s"]["ratio_max"] <= COMPLETION_WITHIN_X
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(result: dict[str, Any]) -> str:
    rows = [("unloaded", result["unloaded"], "")]
    rows += [(name, run, ", ".join(f"{k} x{v}" for k, v in sorted(
        run["attacker"]["outcomes"].items(), key=lambda kv: -kv[1])[:3]))
        for name, run in result["attacks"].items()]
    lines = ["| attack | /health p50 ms | p99 ms | max ms | completion median s | max s | "
             "ratio (median / max) | attacker got |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, run, got in rows:
        h, c = run["health_ms"], run["completion_s"]
        ratio = (f"{_fmt(c.get('ratio_median'), '.2f')}x / {_fmt(c.get('ratio_max'), '.2f')}x"
                 if "ratio_median" in c else "1x")
        lines.append(f"| {name} | {_fmt(h['p50'], '.1f')} | {_fmt(h['p99'], '.1f')} | "
                     f"{_fmt(h['max'], '.1f')} | {_fmt(c['median'], '.3f')} | "
                     f"{_fmt(c['max'], '.3f')} | {ratio} | {got} |")
    return "\n".join(lines)


# -- the run -----------------------------------------------------------------------------------
def wait_for_quiet_host(max_load: float, wait_s: float) -> tuple[list[float], bool]:
    """The load averages once the 1-minute one is at most ``max_load`` (polled for up to
    ``wait_s``), and whether it got there."""
    deadline = time.monotonic() + wait_s
    while True:
        load = list(os.getloadavg())
        if load[0] <= max_load:
            return load, True
        if time.monotonic() >= deadline:
            return load, False
        print(f"load average {load[0]:.2f} > {max_load}: waiting", file=sys.stderr)
        time.sleep(min(10.0, max(0.0, deadline - time.monotonic())))


async def run_attack(name: str, url: str, port: int, model: str, seconds: float,
                     ramp_s: float, measure_async: Callable[[float], Awaitable[dict]],
                     server_pid: int) -> dict[str, Any]:
    attack = KINDS[name](url, port, model, CONNECTIONS[name])
    attack.detail = {}
    cpu_before, server_before = time.process_time(), process_tree_cpu(server_pid)
    started = time.monotonic()
    task = asyncio.create_task(attack.run())
    await asyncio.sleep(ramp_s)  # the attack in full swing before measuring
    if task.done():
        task.result()  # the attack failed: say why
    sample = await measure_async(seconds)
    attack.stop.set()
    await asyncio.wait({task}, timeout=attack.answer_wait_s)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    wall = time.monotonic() - started
    return {"sample": sample, "attacker": {
        "description": DESCRIPTIONS[name], "connections": attack.connections,
        "requests": attack.requests, "outcomes": dict(attack.outcomes),
        "bytes_sent": attack.bytes_sent, **attack.detail, "wall_s": round(wall, 2),
        "attacker_cpu_s": round(time.process_time() - cpu_before, 2),
        "server_cpu_s": round(process_tree_cpu(server_pid) - server_before, 2)}}


def run(args: argparse.Namespace) -> dict[str, Any]:
    load, quiet = wait_for_quiet_host(args.max_load, args.wait_load)
    warning = None
    if not quiet:
        warning = (f"1-minute load average {load[0]:.2f} > {args.max_load} before the run: "
                   "the host was busy, these figures are not a measurement")
        print("!" * 78 + f"\nWARNING: {warning}\n" + "!" * 78, file=sys.stderr)
        if args.refuse_busy:
            raise SystemExit(warning)

    server = EmbeddedServer("", [])
    ctx = multiprocessing.get_context("spawn")
    try:
        server.wait_ready(timeout=300)
        with urllib.request.urlopen(server.url + "/v1/models", timeout=30) as resp:
            model = json.load(resp)["data"][0]["id"]
        with ctx.Pool(1) as pool:
            def measure_sync(seconds: float, **kwargs: int) -> dict:
                return pool.apply(_measure_fn(), (server.url, model, seconds), kwargs)

            async def measure_async(seconds: float) -> dict:
                return await asyncio.get_running_loop().run_in_executor(
                    None, lambda: measure_sync(seconds, min_completions=1))

            measure_sync(0.5, min_completions=2)  # warm-up: both clients, the engine
            unloaded = summary(measure_sync(50 / HEALTH_HZ, min_polls=50, min_completions=5))
            base = unloaded["completion_s"]["median"]
            print(f"unloaded: /health p50 {unloaded['health_ms']['p50']:.1f} ms, "
                  f"completion {base:.3f} s", file=sys.stderr)
            attacks: dict[str, Any] = {}
            unsettled = None
            for name in sorted(args.attacks, key=ATTACKS.index):
                if unsettled:
                    print(f"WARNING: the server was still busy after {unsettled}: {name} "
                          "measures a loaded server", file=sys.stderr)
                done = asyncio.run(run_attack(name, server.url, server.port, model,
                                              args.seconds, args.ramp, measure_async,
                                              server.proc.pid))
                waited, settled = settle(server.url, server.proc.pid)
                unsettled = unsettled or (None if settled else name)
                attacks[name] = {**summary(done["sample"], base),
                                 "attacker": {**done["attacker"], "settle_s": round(waited, 2),
                                              "settled": settled}}
                print(f"{name}: /health max {_fmt(attacks[name]['health_ms']['max'], '.1f')} ms,"
                      f" completion median {_fmt(attacks[name]['completion_s']['median'], '.3f')}"
                      f" s; attacker got {dict(done['attacker']['outcomes'])}", file=sys.stderr)
    finally:
        server.stop()
    return {"target": (f"/health within {HEALTH_WITHIN_MS:.0f} ms and a normal completion "
                       f"within {COMPLETION_WITHIN_X:g}x its unloaded time while one client "
                       "attacks"),
            "load_average_before": load, "load_warning": warning,
            "server_busy_after": unsettled,
            "settings": {"seconds_per_attack": args.seconds, "ramp_s": args.ramp,
                         "server_args": [], "model": model, "body_cap": BODY_CAP,
                         "normal_request": NORMAL, "health_hz": HEALTH_HZ,
                         "attacker_address": ATTACKER, "measurer_address": MEASURER},
            "unloaded": unloaded, "attacks": attacks}


def _measure_fn() -> Callable[..., dict]:
    """``measure`` as the measuring process imports it (not ``__main__``'s)."""
    from bench.attack_latency import measure as imported

    return imported


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="measured seconds per attack")
    ap.add_argument("--attacks", nargs="+", choices=ATTACKS, default=list(ATTACKS))
    ap.add_argument("--ramp", type=float, default=1.0,
                    help="seconds each attack runs before the measuring starts")
    ap.add_argument("--max-load", type=float, default=1.0,
                    help="the highest 1-minute load average a run starts at")
    ap.add_argument("--wait-load", type=float, default=300.0,
                    help="seconds to wait for the load average to drop to --max-load")
    ap.add_argument("--refuse-busy", action="store_true",
                    help="exit rather than run on a busy host (default: warn and record)")
    ap.add_argument("--name", default="attack_latency",
                    help="the result file's name in bench/results/")
    args = ap.parse_args(argv)
    result = run(args)
    from bench.common import host_line, write_result

    path = write_result(args.name, result)
    print(table(result))
    print(f"\nhost: {host_line(json.loads(path.read_text())['machine'])}")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in result['load_average_before'])}"
          + (f"  WARNING: {result['load_warning']}" if result["load_warning"] else ""))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
