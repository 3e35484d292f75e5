"""A model runner in this process (``create_model_runner``), and the worker process that runs
one rank of a tensor-parallel group, or of a pipeline stage's group (``worker_main``).

Rank 0 takes each call from the engine over a pipe and broadcasts it to the other ranks (a
gloo group, so ranks on other machines get it too); every rank runs it on its shard of the
model, and rank 0 answers, in the calls' order. With pipeline stages every stage runs the same
step plans on its layers, several steps in flight at once (``gpu/pipeline_rounds.py``), and
the last stage's sampled tokens reach every rank (``gpu/pipeline.py``), rank 0 included: a
call may be answered with the answers of older steps before its own. A worker dies with its
server: it never outlives it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from tidal.core.config import EngineConfig
from tidal.gpu.cpu.host_allocator import release_freed_host_memory
from tidal.gpu.distributed import TensorParallel, init_tensor_parallel, leave_tensor_parallel
from tidal.gpu.model_checks import check_against_checkpoint, fit_context
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.model_loader import resolve_dtype
from tidal.gpu.model_runner import ModelRunner
from tidal.gpu.pipeline import pipeline_stage
from tidal.gpu.pipeline_rounds import StepRounds

logger = logging.getLogger(__name__)
SHUTDOWN = "shutdown"
DRAIN = "drain"  # finish every step in the pipe (the executor waits on the oldest)
_PR_SET_PDEATHSIG = 1


def create_model_runner(config: EngineConfig) -> ModelRunner:
    """The runner, once the model's files are checked against each other and the machine
    (``gpu/model_checks.py``): a config the weights or the memory cannot back fails here, in
    seconds, before anything is allocated; the context is clamped to what memory holds."""
    model_config = ModelConfig.load(config.model)
    file_bytes = check_against_checkpoint(config.model, model_config)
    itemsize = resolve_dtype(config.dtype, config.device).itemsize
    max_model_len = fit_context(config, model_config, file_bytes, itemsize)
    return ModelRunner(config, model_config, max_model_len)


@dataclass
class WorkerArgs:
    config: EngineConfig
    rank: int
    local_rank: int
    init_method: str
    num_threads: int
    log_level: int


class Worker:
    """One rank's model runner, and the calls the engine makes of it."""

    def __init__(self, runner: ModelRunner, tp: TensorParallel) -> None:
        self.runner, self.tp, self.stage = runner, tp, pipeline_stage()
        self.rounds = StepRounds(runner, self.stage) if self.stage.size > 1 else None

    def answer(self, method: str, args: tuple) -> list[Any]:
        """The answers a call brings: with stages, a step with work enters the pipe and
        brings those of the steps it pushed out (maybe none); anything else first drains it."""
        rounds = self.rounds
        if rounds is None:
            return [getattr(self, method)(*args)]
        if method == "execute_model" and not args[0].is_empty:
            return rounds.step(args[0])
        return [*rounds.drain(), getattr(self, method)(*args)]

    def drain(self) -> None:
        """The executor's ``DRAIN``: ``answer`` emptied the pipe before this; nothing is left."""

    def describe(self) -> dict[str, Any]:
        r = self.runner
        return dict(max_model_len=r.max_model_len, vocab_size=r.vocab_size,
                    eos_token_ids=r.eos_token_ids,
                    attention_cost_context=r.attention_cost_context,
                    model_config=r.model_config,
                    dtype_name=str(r.dtype).removeprefix("torch."))

    def determine_num_blocks(self) -> int:
        """The fewest blocks any rank's budget holds (ranks may have different memory, and
        stages different layers), so that every stage's cache has the same blocks."""
        n = torch.tensor([self.runner.determine_num_blocks()], dtype=torch.int64)
        if self.tp.world_size > 1:
            dist.all_reduce(n, op=dist.ReduceOp.MIN, group=self.tp.cpu_group)
        return int(n.item())

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def host_blocks(self) -> int:
        return self.runner.host_tier.num_blocks if self.runner.host_tier else 0

    def disk_index(self) -> tuple[int, dict[int, bytes]]:
        return self.runner.disk_index()

    def apply_kv_copies(self, copies: Any) -> None:
        self.runner.apply_kv_copies(copies)

    def execute_model(self, sched: Any) -> Any:
        """A step without stages; with stages, an empty one (only its plan's removals and
        copies), which every stage runs once the pipe is drained."""
        return self.runner.execute_model_async(sched).result()

    def release_host_memory(self) -> None:
        release_freed_host_memory()

    def kernel_summary(self) -> str:
        return self.runner.kernel_summary()


def worker_main(args: WorkerArgs, conn: Connection | None) -> None:
    """A worker process's body. ``conn`` (rank 0's only) is the pipe to the engine."""
    _die_with_parent()
    _set_up_logging(args)
    config = args.config
    try:
        torch.set_num_threads(args.num_threads)
        if config.device != "cpu":
            config = replace(config, device=f"cuda:{args.local_rank}")
            torch.cuda.set_device(config.device)
        tp = init_tensor_parallel(args.rank, config.tensor_parallel_size, args.init_method,
                                  config.device, pipeline_size=config.pipeline_parallel_size)
        worker = Worker(create_model_runner(config), tp)
        torch.manual_seed(config.seed)  # from here every rank draws the same samples
        with worker.runner.step_modes():
            _serve_calls(worker, conn)
    except BaseException as exc:  # noqa: BLE001 - a failed rank must end, loudly
        logger.error("rank %d failed: %s", args.rank, traceback.format_exc())
        if conn is not None:
            try:
                conn.send(("error", f"rank {args.rank}: {exc!r}"))
            except OSError:
                pass
        os._exit(1)  # no clean-up that could wait on a peer
    leave_tensor_parallel()


def _serve_calls(worker: Worker, conn: Connection | None) -> None:
    """Take calls until told to stop: rank 0 from the engine's pipe, broadcast to the others;
    rank 0 answers each."""
    tp = worker.tp
    while True:
        call = conn.recv() if conn is not None else None
        method, call_args = tp.broadcast_object(call)
        if method == SHUTDOWN:
            return
        for result in worker.answer(method, call_args):
            if conn is not None:
                conn.send(("ok", result))


def _die_with_parent() -> None:
    """Be killed when the server process ends, however it ends: the kernel's parent-death
    signal on Linux, and a thread that watches the parent elsewhere."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="tidal-parent-watch", daemon=True).start()


def _set_up_logging(args: WorkerArgs) -> None:
    level = args.log_level if args.rank == 0 else max(args.log_level, logging.WARNING)
    logging.basicConfig(level=level, format=f"%(asctime)s %(levelname)s [rank {args.rank}] "
                                            "%(name)s: %(message)s")
