"""A worker process per rank of this machine (``gpu/worker.py``): tensor-parallel ranks, in
every pipeline stage.

Each call goes to rank 0 over a pipe (the step plan pickled: lists and numbers, no tensors),
which hands it to every rank. Calls are answered in order, so a step can be launched before
the previous one's tokens are read: the engine schedules step N+1 while the workers compute
step N. With N pipeline stages a step is answered only once N - 1 later steps are sent
(``gpu/pipeline_rounds.py``): the engine keeps N in flight (``max_steps_in_flight``), and
waiting on a step with fewer behind it first sends a ``drain``. A worker that dies or raises
fails the call waiting on it, or (between steps) calls ``on_failure``; the other workers are
then stopped: nothing hangs and nothing is left running.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn

import torch

from tidal.core.config import EngineConfig
from tidal.core.executor import Executor, ExecutorFailedError, StepResult
from tidal.core.host_tier import KVCopies
from tidal.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from tidal.core.step_profiler import StepProfiler
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.pipeline import check_pipeline_parallel
from tidal.gpu.weight_shards import check_tensor_parallel
from tidal.gpu.worker import DRAIN, SHUTDOWN, WorkerArgs, worker_main

logger = logging.getLogger(__name__)
STOP_TIMEOUT_S = 5.0


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        model_config = ModelConfig.load(config.model)
        check_tensor_parallel(model_config, config.tensor_parallel_size)
        check_pipeline_parallel(model_config, config.pipeline_parallel_size, config.quantization,
                                config.runner, config.speculative_config is not None)
        self._config = config
        self.profiler = StepProfiler()  # the workers time their own phases
        self._lock = threading.Lock()  # one caller of the pipe at a time
        self._sent = self._received = 0  # calls sent to rank 0, answers read
        self._answers: dict[int, Any] = {}
        self.max_steps_in_flight = config.pipeline_parallel_size
        self._pipe = _StepsSent(self.max_steps_in_flight)
        self._failed: BaseException | None = None
        self._stopping = False
        self.workers, self._conn = self._start_workers(config)
        try:
            info = self._answer(self._send("describe"))
        except BaseException:
            self.shutdown()
            raise
        for name, value in info.items():
            setattr(self, name, value)
        threading.Thread(target=self._watch, name="tidal-worker-watch", daemon=True).start()
        logger.info("%s in worker processes %s", _layout(config),
                    [p.pid for p in self.workers])

    def _start_workers(self, config: EngineConfig) -> tuple[list[Any], Any]:
        """The ranks, and the connection to rank 0 (``gpu/ray_executor.py`` places them
        with Ray instead)."""
        return start_workers(config, with_pipe=True)

    # -- calls --------------------------------------------------------------------------
    def determine_num_blocks(self) -> int:
        return self._call("determine_num_blocks")

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._call("allocate_kv_cache", num_blocks)

    def host_blocks(self) -> int:
        return self._call("host_blocks")

    def disk_index(self) -> tuple[int, dict[int, bytes]]:
        return self._call("disk_index")  # rank 0's: every rank writes the same slots

    def apply_kv_copies(self, copies: KVCopies) -> None:
        self._call("apply_kv_copies", copies)

    def execute_model_async(self, sched: SchedulerOutput,
                            before_forward: Callable[[], None] | None = None) -> StepResult:
        seq = self._send("execute_model", sched)
        if before_forward is not None and not sched.is_empty:
            before_forward()  # the workers compute meanwhile
        return _RemoteStep(self, seq)

    def release_host_memory(self) -> None:
        self._call("release_host_memory")

    def kernel_summary(self) -> str:
        return f"{self._call('kernel_summary')} (rank 0; {_layout(self._config)})"

    def _call(self, method: str, *args: Any) -> Any:
        return self._answer(self._send(method, *args))

    def _send(self, method: str, *args: Any) -> int:
        with self._lock:
            self._raise_if_failed()
            try:
                self._conn.send((method, args))
            except OSError as exc:
                self._fail(ExecutorFailedError(f"rank 0 is gone: {exc!r}"))
            self._sent += 1
            self._pipe.sent(self._sent, method == "execute_model" and not args[0].is_empty)
            return self._sent

    def _step_answer(self, seq: int) -> ModelRunnerOutput:
        """Step ``seq``'s tokens; with stages, a ``drain`` first where too few steps were
        sent after it to push it out of the pipe (its answer is read and dropped)."""
        if not self._pipe.answerable(seq):
            self._pipe.dropped.add(self._send(DRAIN))
        return self._answer(seq)

    def _answer(self, seq: int) -> Any:
        """Call ``seq``'s answer, reading the answers before it first (kept for their
        callers)."""
        with self._lock:
            while seq not in self._answers:
                self._raise_if_failed()
                self._received += 1
                answer = self._read()
                if answer[0] == "ok" and self._received in self._pipe.dropped:
                    self._pipe.dropped.discard(self._received)  # a drain's
                else:
                    self._answers[self._received] = answer
            status, value = self._answers.pop(seq)
        if status != "ok":
            self._fail(ExecutorFailedError(f"a worker failed: {value}"))
        return value

    def _read(self) -> tuple[str, Any]:
        ready = wait([self._conn, *(p.sentinel for p in self.workers)])
        if self._conn in ready:
            try:
                return self._conn.recv()
            except (EOFError, OSError):
                pass
        dead = [p for p in self.workers if not p.is_alive()]
        self._fail(ExecutorFailedError(_deaths(dead) or "rank 0's pipe closed"))

    # -- failure and shutdown -----------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            raise self._failed

    def _record_failure(self, exc: ExecutorFailedError) -> None:
        """The first failure stands; it stops every worker."""
        if self._failed is None:
            self._failed = exc
            logger.error("%s; stopping the workers", exc)
            self._stop_workers(graceful=False)

    def _fail(self, exc: ExecutorFailedError) -> NoReturn:
        self._record_failure(exc)
        raise self._failed  # type: ignore[misc]

    def _watch(self) -> None:
        """Between steps, a dead worker is noticed here (within a step, by ``_read``)."""
        wait([p.sentinel for p in self.workers])
        if self._stopping or self._failed is not None:
            return
        dead = [p for p in self.workers if not p.is_alive()]
        self._record_failure(ExecutorFailedError(_deaths(dead)))
        if self.on_failure is not None and self._failed is not None:
            self.on_failure(self._failed)

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._stop_workers(graceful=self._failed is None)

    def _stop_workers(self, graceful: bool) -> None:
        if graceful:
            try:
                self._conn.send((SHUTDOWN, ()))
            except OSError:
                pass
        stop_processes(self.workers, STOP_TIMEOUT_S if graceful else 0.0)
        self._conn.close()


class _RemoteStep:
    def __init__(self, executor: MultiprocExecutor, seq: int) -> None:
        self._executor, self._seq = executor, seq

    def result(self) -> ModelRunnerOutput:
        return self._executor._step_answer(self._seq)


class _StepsSent:
    """Which calls rank 0 will answer without more calls: with ``depth`` stages, a step with
    work is answered once ``depth - 1`` more are sent, and any other call pushes out every
    step before it."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.flushed = 0  # every call up to this one will be answered
        self.steps: list[int] = []  # the steps with work sent since
        self.dropped: set[int] = set()  # drains: their answers are read and dropped

    def sent(self, seq: int, is_step: bool) -> None:
        if not is_step or self.depth == 1:
            self.flushed, self.steps = seq, []
            return
        self.steps.append(seq)
        if len(self.steps) >= self.depth:
            self.flushed = self.steps.pop(0)

    def answerable(self, seq: int) -> bool:
        return seq <= self.flushed


def start_workers(config: EngineConfig, with_pipe: bool
                  ) -> tuple[list[mp.process.BaseProcess], Connection | None]:
    """This node's worker processes (ranks ``node_rank * local ... + local - 1``), and the
    pipe to rank 0 where it is one of them."""
    local = config.world_size // config.nnodes
    init_method = config.distributed_init_method or f"tcp://127.0.0.1:{_free_port()}"
    threads = int(os.environ.get("TIDAL_WORKER_THREADS", 0)) or max(
        1, torch.get_num_threads() // local)
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe() if with_pipe else (None, None)
    workers = []
    for local_rank in range(local):
        rank = config.node_rank * local + local_rank
        args = WorkerArgs(config, rank, local_rank, init_method, threads,
                          logging.getLogger().getEffectiveLevel())
        conn = theirs if rank == 0 else None
        workers.append(ctx.Process(target=worker_main, args=(args, conn), daemon=True,
                                   name=f"tidal-worker-{rank}"))
    for p in workers:
        p.start()
    if theirs is not None:
        theirs.close()
    return workers, ours


def stop_processes(processes: list[mp.process.BaseProcess], timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for the processes to end, then kill those left."""
    for p in processes:
        p.join(timeout_s)
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join(STOP_TIMEOUT_S)


def _layout(config: EngineConfig) -> str:
    """The ranks' layout in words: ``tensor parallel over 2, 2 pipeline stages``."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    parts = [f"tensor parallel over {tp}"] if tp > 1 or pp == 1 else []
    return ", ".join(parts + ([f"{pp} pipeline stages"] if pp > 1 else []))


def _deaths(dead: list[mp.process.BaseProcess]) -> str:
    return ", ".join(f"worker {p.name} (pid {p.pid}) exited with code {p.exitcode}"
                     for p in dead)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
