"""Tensor-parallel ranks as Ray actors (``--distributed-executor-backend ray``).

Ray finds the devices and keeps the processes: tidal joins the cluster it finds (``RAY_ADDRESS``,
or a ``ray start --head`` on this machine) or starts one here, reserves a placement group of one
bundle per rank (a CPU per rank on the CPU device, a GPU per rank on CUDA) and starts an actor
in each bundle. Each actor then runs the very body of a multiprocess worker
(``gpu/worker.py``'s ``worker_main``): it joins the torch.distributed group at rank 0's address
and serves calls, rank 0 taking them over a socket from the engine (a
``multiprocessing.connection``, the same calls as the multiprocess executor's pipe) and
broadcasting them to the other ranks. So the calls and their order are the multiprocess
executor's (``MultiprocExecutor``, which this class extends): a step is launched before the
previous one's tokens are read, and answers come back in order.

What differs is how a dead rank is seen: each actor's ``run`` call lasts as long as its worker,
so its result (an error, once Ray sees the actor die) is what the watcher thread waits on.
Shutdown kills every actor, removes the placement group, and ends the Ray session: a local Ray
that tidal started stops with it; a cluster it joined keeps running, without tidal's actors.

Ray is an optional dependency (``pip install 'tidal[ray]'``), imported only here and only when
this executor is built.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener, wait
from typing import Any

from tidal.core.config import EngineConfig
from tidal.core.executor import ExecutorFailedError
from tidal.gpu.multiproc_executor import STOP_TIMEOUT_S, MultiprocExecutor, _free_port
from tidal.gpu.worker import SHUTDOWN, WorkerArgs, worker_main

logger = logging.getLogger(__name__)
PLACEMENT_TIMEOUT_S = float(os.environ.get("TIDAL_RAY_PLACEMENT_TIMEOUT", 120))
RAY_MISSING = ("--distributed-executor-backend ray needs Ray, an optional dependency: "
               "pip install 'tidal[ray]'")


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise RuntimeError(RAY_MISSING) from exc
    return ray


class RankActor:
    """One rank's process, placed by Ray: ``run`` is a worker process's body."""

    def __init__(self) -> None:
        self._listener: Listener | None = None

    def where(self) -> tuple[str, int, int, int]:
        """This actor's node address, a free port there, its CPU count and its pid."""
        ip = import_ray().util.get_node_ip_address()
        return ip, _free_port(), os.cpu_count() or 1, os.getpid()

    def listen(self, authkey: bytes) -> tuple[str, int]:
        """Rank 0's door for the engine's calls: where the engine connects."""
        address = (import_ray().util.get_node_ip_address(), 0)
        self._listener = Listener(address, authkey=authkey)
        return self._listener.address

    def run(self, args: WorkerArgs) -> None:
        """The worker, until it is told to stop; then the actor ends, as a worker process
        does (a failed worker ends its process itself). So this call never returns: its
        error, once Ray has seen the actor end, is the engine's sign that the rank is gone."""
        conn = None
        if self._listener is not None:
            conn = self._listener.accept()
            self._listener.close()
        worker_main(args, conn)
        import_ray().actor.exit_actor()


@dataclass
class RankHandle:
    """The engine's view of one rank's actor (``RankActor.where``'s answers)."""

    rank: int
    actor: Any
    node_ip: str
    port: int  # free on its node when asked: rank 0's is the group's meeting port
    cpus: int
    pid: int
    run: Any = None  # the ObjectRef of its ``run`` call: resolves when the worker ends

    @property
    def name(self) -> str:
        return f"tidal-rank-{self.rank}"


class RayExecutor(MultiprocExecutor):
    """The multiprocess executor's calls, to ranks that Ray placed."""

    def _start_workers(self, config: EngineConfig) -> tuple[list[RankHandle], Connection]:
        self._ray = ray = import_ray()
        self._pg: Any = None
        self._released = False
        self._watch_done, self._watching = threading.Event(), False
        self.workers: list[RankHandle] = []
        self._joined_session = ray.is_initialized()  # the caller's session: left connected
        if not self._joined_session:
            _connect(ray, config)
        try:
            return self._place_and_run(config)
        except BaseException:
            self._release()
            self._end_session()
            raise

    def _place_and_run(self, config: EngineConfig) -> tuple[list[RankHandle], Connection]:
        ray, size = self._ray, config.world_size
        bundle = {"CPU": 1.0} if config.device == "cpu" else {"GPU": 1.0}
        self._pg = pg = ray.util.placement_group([bundle] * size, strategy="PACK")
        try:
            ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"Ray could not place {size} ranks of {bundle} in {PLACEMENT_TIMEOUT_S:.0f} s; "
                f"the cluster has {ray.cluster_resources()}") from None
        self.workers = _start_actors(ray, pg, bundle, size)
        rank0 = self.workers[0]
        authkey = secrets.token_bytes(32)
        address = ray.get(rank0.actor.listen.remote(authkey))
        init_method = f"tcp://{rank0.node_ip}:{rank0.port}"
        for h in self.workers:
            local = sum(o.node_ip == h.node_ip for o in self.workers)
            threads = int(os.environ.get("TIDAL_WORKER_THREADS", 0)) or max(1, h.cpus // local)
            args = WorkerArgs(config, h.rank, 0, init_method, threads,
                              logging.getLogger().getEffectiveLevel())
            h.run = h.actor.run.remote(args)
        return self.workers, Client(address, authkey=authkey)

    # -- failure ------------------------------------------------------------------------
    def _read(self) -> tuple[str, Any]:
        """Rank 0's next answer; while none comes, a rank that ended (one that failed while
        loading, say, leaving the others waiting for it) fails the call."""
        refs = [h.run for h in self.workers]
        try:
            while True:
                if wait([self._conn], timeout=0.5):
                    return self._conn.recv()
                if self._ray.wait(refs, num_returns=1, timeout=0)[0]:
                    break
        except (EOFError, OSError):
            pass
        self._fail(ExecutorFailedError(self._deaths(timeout_s=1.0) or
                                       "rank 0's connection closed"))

    def _watch(self) -> None:
        """Between steps, a dead rank is noticed here: its ``run`` call ends."""
        self._watching = True
        try:
            refs = [h.run for h in self.workers]
            while not self._stopping and self._failed is None:
                ready, _ = self._ray.wait(refs, num_returns=1, timeout=0.5)
                if ready:
                    break
            if self._stopping or self._failed is not None:
                return
            self._record_failure(ExecutorFailedError(self._deaths(timeout_s=0.0)))
        except Exception:  # noqa: BLE001 - Ray's session ended under a late watcher
            if not self._stopping:
                raise
            return
        finally:
            self._watch_done.set()
        if self.on_failure is not None and self._failed is not None:
            self.on_failure(self._failed)

    def _deaths(self, timeout_s: float) -> str:
        """The ranks that ended (waiting up to ``timeout_s`` for them), and how, in Ray's
        words (the first line of its error)."""
        refs = [h.run for h in self.workers]
        ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        ended = []
        for h in self.workers:
            if h.run not in ready:
                continue
            try:
                self._ray.get(h.run)
                why = "returned"
            except Exception as exc:  # noqa: BLE001 - any error is the rank's death
                why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
            ended.append(f"rank {h.rank} (actor pid {h.pid} on {h.node_ip}) {why}")
        return "; ".join(ended)

    # -- shutdown -----------------------------------------------------------------------
    def shutdown(self) -> None:
        super().shutdown()
        if self._watching:
            self._watch_done.wait(STOP_TIMEOUT_S)
        self._end_session()

    def _stop_workers(self, graceful: bool) -> None:
        if graceful and not self._released:
            try:
                self._conn.send((SHUTDOWN, ()))
                self._ray.wait([h.run for h in self.workers], num_returns=len(self.workers),
                               timeout=STOP_TIMEOUT_S)
            except OSError:
                pass
        self._release()
        self._conn.close()

    def _release(self) -> None:
        """Kill every actor and remove the placement group (once)."""
        if self._released:
            return
        self._released = True
        for h in self.workers:
            self._ray.kill(h.actor, no_restart=True)
        runs = [h.run for h in self.workers if h.run is not None]
        if runs:  # each run call fails once Ray has marked its actor dead
            self._ray.wait(runs, num_returns=len(runs), timeout=STOP_TIMEOUT_S)
        _wait_gone([h.pid for h in self.workers
                    if h.node_ip == self._ray.util.get_node_ip_address()])
        if self._pg is not None:
            self._ray.util.remove_placement_group(self._pg)

    def _end_session(self) -> None:
        """Leave the Ray session tidal opened: a local Ray it started stops; a cluster it
        joined keeps running. A session the caller opened is left as it was."""
        if not self._joined_session and self._ray.is_initialized():
            self._ray.shutdown()


def _wait_gone(pids: list[int]) -> None:
    """Wait (a while) for this node's killed actor processes to end: Ray marks an actor dead
    before its process has ended."""
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.02)


def _connect(ray: Any, config: EngineConfig) -> None:
    """Join ``RAY_ADDRESS``'s cluster, else one running on this machine, else start one."""
    quiet = dict(include_dashboard=False, logging_level=logging.WARNING)
    if os.environ.get("RAY_ADDRESS"):
        ray.init(**quiet)
        return
    try:
        ray.init(address="auto", **quiet)
        logger.info("Ray: joined the cluster running on this machine")
    except ConnectionError:
        cpus = os.cpu_count() or 1
        if config.device == "cpu":  # a rank per CPU bundle, even past the cores (as mp runs)
            cpus = max(cpus, config.world_size)
        ray.init(num_cpus=cpus, **quiet)
        logger.info("Ray: started a local instance with %d CPUs", cpus)


def _start_actors(ray: Any, pg: Any, bundle: dict[str, float], size: int) -> list[RankHandle]:
    """An actor in each bundle, ranked by node (the engine's node first) so that a node's
    ranks are neighbours."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    remote = ray.remote(RankActor)
    actors = [remote.options(
        num_cpus=bundle.get("CPU", 0.0), num_gpus=bundle.get("GPU", 0.0),
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=i)).remote() for i in range(size)]
    places = ray.get([a.where.remote() for a in actors])
    here = ray.util.get_node_ip_address()
    order = sorted(range(size), key=lambda i: (places[i][0] != here, places[i][0], i))
    return [RankHandle(rank, actors[i], *places[i]) for rank, i in enumerate(order)]
