"""The one door from the engine into device code.

``EngineCore`` decides what runs; an ``Executor`` runs it: in this process on one device
(``gpu/executor.py``'s ``UniProcExecutor``), or on a worker process per rank of a
tensor-parallel group, in every pipeline stage (``gpu/multiproc_executor.py``), whose rank 0
sends the sampled tokens back. The engine sees the same calls either way.

``create_executor`` and ``run_worker_node`` are the only places outside ``gpu/`` that import
it (``tests/unit/test_import_rules.py`` holds every other module to that): ``app/`` reaches the
device through the engine, and the engine through these two.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from tidal.core.host_tier import KVCopies
from tidal.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from tidal.core.step_profiler import StepProfiler

if TYPE_CHECKING:
    from tidal.core.config import EngineConfig


class StepResult(Protocol):
    """A launched step; ``result()`` waits for its sampled tokens."""

    def result(self) -> ModelRunnerOutput: ...


class ExecutorFailedError(RuntimeError):
    """A worker died or raised: no step can run any more."""


class Executor(ABC):
    # what the model is, for the engine: set by the executor once the model is loaded
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    attention_cost_context: int
    model_config: Any  # the architecture facts (gpu.model_config.ModelConfig)
    dtype_name: str  # the model's dtype, e.g. "float32"
    profiler: StepProfiler
    # steps the engine keeps in flight, of disjoint requests: one per pipeline stage
    max_steps_in_flight: int = 1
    # called from another thread when a worker fails between steps (a step in flight raises
    # ``ExecutorFailedError`` itself)
    on_failure: Callable[[BaseException], None] | None = None

    @abstractmethod
    def determine_num_blocks(self) -> int:
        """How many KV-cache blocks fit the budget (on every rank)."""

    @abstractmethod
    def allocate_kv_cache(self, num_blocks: int) -> None: ...

    def host_blocks(self) -> int:
        """Blocks of the host tier (``--kv-offload-size``) the cache allocated; 0: none."""
        return 0

    def disk_index(self) -> tuple[int, dict[int, bytes]]:
        """The disk tier's slots (``--kv-offload-path``) and the block hash each filled one
        holds, as found at start; (0, {}): no disk tier."""
        return 0, {}

    def apply_kv_copies(self, copies: KVCopies) -> None:  # noqa: B027 - no tier by default
        """Run tier copies outside a step (a shutdown's, ``HostTier.persist``), to the end."""

    def take_kv_copy_timing(self) -> dict[str, tuple[int, float]]:
        """The second tier's copies into the device since the last call, per tier ("host",
        "disk"): (blocks, seconds); empty where not measured (across processes)."""
        return {}

    @abstractmethod
    def execute_model_async(self, sched: SchedulerOutput,
                            before_forward: Callable[[], None] | None = None) -> StepResult:
        """Launch a step; ``before_forward`` runs once it is under way, before its forward
        completes (not at all for an empty step)."""

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(sched).result()

    def step_modes(self) -> contextlib.AbstractContextManager[None]:
        """Thread modes to hold for a run of steps on the calling thread."""
        return contextlib.nullcontext()

    def release_host_memory(self) -> None:  # noqa: B027 - nothing kept by default
        """Hand back to the OS the host memory the C allocator kept from the last steps'
        temporaries (on every rank): the engine calls it once it has idled a while."""

    @abstractmethod
    def kernel_summary(self) -> str:
        """What runs the model's ops, in a line for the start-up banner."""

    def shutdown(self) -> None:  # noqa: B027 - most executors hold nothing to release
        """Release the workers (nothing to do in this process)."""


def create_executor(config: EngineConfig) -> Executor:
    """The executor ``config`` asks for: the model in this process, or a worker process per
    tensor-parallel rank (``gpu/executor.py``)."""
    from tidal.gpu.executor import create_executor as create

    return create(config)


def cpu_plans(action: str) -> str:
    """``tidal plans``: this machine's CPU plan files shown (``show``), marked to be timed
    again (``retime``) or deleted (``clear``); what was done (``gpu/cpu/plan_files.py``)."""
    from tidal.gpu.cpu.plan_files import run

    return run(action)


def run_worker_node(config: EngineConfig) -> int:
    """A node past the first of a multi-node group: its ranks' worker processes, until they
    end; their largest exit code."""
    from tidal.gpu.multiproc_executor import start_workers, stop_processes

    workers, _ = start_workers(config, with_pipe=False)
    try:
        for p in workers:
            p.join()
    except KeyboardInterrupt:
        stop_processes(workers, 0.0)
    return max((p.exitcode or 0) for p in workers)
