"""Child processes the benchmarks and tests start and stop: servers on a free loopback port,
browsers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def stop_process(proc: subprocess.Popen, timeout: float) -> int:
    """SIGTERM ``proc``, give it ``timeout`` seconds to exit, SIGKILL it if it has not, and
    return its exit code. A process that has already exited is left as it is."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def stop_process_group(proc: subprocess.Popen, timeout: float) -> int:
    """``stop_process`` for a process started with ``start_new_session``: SIGTERM goes to its
    whole group (its worker processes too), SIGKILL to what is left of it after ``timeout``."""
    group = os.getpgid(proc.pid)
    os.killpg(group, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):  # the workers may linger after the leader
        os.killpg(group, signal.SIGKILL)
    proc.wait()
    return proc.returncode


_HANDED_OUT: set[int] = set()
# What a server prints when another process took its port between free_port() and its bind.
PORT_TAKEN = b"Address already in use"
LAUNCH_ATTEMPTS = 3


def free_port() -> int:
    """A loopback TCP port nothing listens on now, and not handed out before in this process
    (servers started together get different ports)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


class LaunchedServer:
    """A server process on a free loopback port; subclasses change ``command`` and may change
    ``env``, what its log says when its port was taken, and whether it runs in a process group
    of its own (a server with worker processes: ``stop`` then signals all of them)."""

    port_taken: tuple[bytes, ...] = (PORT_TAKEN,)
    process_group = False

    def __init__(self, model: str, server_args: list[str]) -> None:
        self.model = model
        self.server_args = list(server_args)
        self._launch()

    def _launch(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+b", suffix=".log", delete=False)
        self.proc = subprocess.Popen(self.command(), cwd=ROOT, stdout=self.log,
                                     stderr=subprocess.STDOUT, env=self.env(),
                                     start_new_session=self.process_group)

    def env(self) -> dict[str, str]:
        return {**os.environ, "TOKENIZERS_PARALLELISM": "false"}

    def command(self) -> list[str]:
        return [sys.executable, "-m", "tidal", "serve", "--model", self.model, "--port",
                str(self.port), *self.server_args]

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Wait for /health; a server whose port was taken before it could bind is started
        again on another port (``url`` changes)."""
        deadline = time.monotonic() + timeout
        for attempt in range(LAUNCH_ATTEMPTS):
            if attempt:  # the last process exited: its port was taken
                self.log.close()
                self._launch()
            if self._wait_once(deadline):
                return
        raise RuntimeError(f"no free port after {LAUNCH_ATTEMPTS} tries")

    def _wait_once(self, deadline: float) -> bool:
        """True once /health answers; False if the server exited because its port was taken."""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = Path(self.log.name).read_bytes()
                if any(marker in log for marker in self.port_taken):
                    return False
                raise RuntimeError(f"the server exited: {log.decode(errors='replace')}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return True
            except OSError:  # refused while starting, or an HTTP error status
                pass
            time.sleep(0.5)
        raise TimeoutError("the server did not come up")

    def memory(self) -> dict[str, float] | None:
        """``tree_memory_mb`` of the server's process; None once it has exited."""
        if self.proc.poll() is not None:
            return None
        try:
            return tree_memory_mb(self.proc.pid)
        except (OSError, KeyError):
            return None

    def stop(self) -> None:
        if self.process_group and self.proc.poll() is None:
            stop_process_group(self.proc, 60)
        else:
            stop_process(self.proc, 60)


class SglangRouter(LaunchedServer):
    """sglang-router in front of running replicas (``worker_urls``) with ``router_args`` (its
    policy, ...), on a free port; it checks their /health every second and takes one failure
    as a replica gone. Ready once it has registered every replica (``wait_ready``)."""

    def __init__(self, worker_urls: list[str], router_args: list[str]) -> None:
        self.worker_urls = list(worker_urls)
        self.router_args = list(router_args)
        super().__init__("", [])

    def command(self) -> list[str]:
        return [sys.executable, "-m", "sglang_router.launch_router",
                "--worker-urls", *self.worker_urls, "--host", "127.0.0.1",
                "--port", str(self.port),
                "--prometheus-port", str(free_port()),  # its default, 29000, may be taken
                "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                "--log-level", "warn", *self.router_args]

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        super().wait_ready(timeout)
        while self.healthy_workers() != len(self.worker_urls):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = Path(self.log.name).read_text(errors="replace")
                raise RuntimeError(f"the router never registered its replicas:\n{log}")
            time.sleep(0.5)

    def healthy_workers(self) -> int:
        """Replicas the router would send a request to now."""
        with urllib.request.urlopen(self.url + "/workers", timeout=10) as resp:
            return sum(w["is_healthy"] for w in json.load(resp)["workers"])


def memory_mb(pid: int) -> dict[str, float]:
    """The process's resident set now (``VmRSS``) and at its peak (``VmHWM``), in MB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024 / 1e6
    return {"rss_mb": round(fields["VmRSS"], 1), "peak_rss_mb": round(fields["VmHWM"], 1)}


def descendants(pid: int) -> list[int]:
    """The ids of ``pid``'s living child processes, their children, and so on."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # it exited while we looked
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo += children.get(child, [])
    return found


def tree_memory_mb(pid: int) -> dict[str, float]:
    """``memory_mb`` summed over the process and its descendants (a server's worker
    processes), with the process's own count beside: what serving from it keeps resident.
    The peaks are each process's own, summed: an upper bound of the tree's peak."""
    own = memory_mb(pid)
    total = dict(own)
    for child in descendants(pid):
        try:
            theirs = memory_mb(child)
        except (OSError, KeyError):  # exited, or a zombie without a resident set
            continue
        total = {k: round(total[k] + theirs[k], 1) for k in total}
    return total | {"main_rss_mb": own["rss_mb"]}


@dataclass
class CommandRun:
    returncode: int | None  # None when it was killed at its limit
    wall_s: float
    output: str
    log: Path

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def run_command(cmd: list[str], limit_s: float, log: Path,
                env: dict[str, str] | None = None) -> CommandRun:
    """``cmd`` in a session of its own, output to ``log``; at ``limit_s`` its whole process
    group (pytest's workers, a server it started) is stopped."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            stop_process_group(proc, 10)
            code = None
    return CommandRun(code, time.monotonic() - start, log.read_text(errors="replace"), log)


def wait_settled(url: str, limit_s: float = 900.0) -> float:
    """Seconds until a tidal server has swapped in what it prepares in the background (its
    CPU kernels built, its plans timed, noisy plans timed again: ``kernels`` in
    ``/get_server_info``), so that a benchmark measures the server as it goes on serving,
    not its first minutes, and no re-time runs beside a peer's rounds. A one-token
    completion every five seconds gives it the step it swaps at; while noisy plans wait for
    an idle engine it is left alone. Past ``limit_s`` it says so and returns."""
    start = time.monotonic()
    while True:
        with urllib.request.urlopen(url + "/get_server_info", timeout=30) as resp:
            info = json.loads(resp.read())
        kernels = info.get("kernels", "")
        if time.monotonic() - start > limit_s:
            print(f"[tidal] still upgrading after {limit_s:.0f} s: {kernels}", flush=True)
            return time.monotonic() - start
        if "timed again once idle" in kernels:
            time.sleep(5.0)
            continue
        if "in the background" not in kernels and "at the next step" not in kernels:
            return time.monotonic() - start
        body = json.dumps({"model": info["served_model_name"], "prompt": "a", "max_tokens": 1})
        request = urllib.request.Request(url + "/v1/completions", data=body.encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60):
            pass
        time.sleep(5.0)
