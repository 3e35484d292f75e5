"""The executors of ``core/executor.py``, and the door the engine opens: ``create_executor``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from tidal.core.config import EngineConfig
from tidal.core.executor import Executor, StepResult
from tidal.core.host_tier import KVCopies
from tidal.core.scheduler_output import SchedulerOutput
from tidal.core.step_profiler import StepProfiler
from tidal.gpu.cpu.host_allocator import release_freed_host_memory
from tidal.gpu.worker import create_model_runner


def create_executor(config: EngineConfig) -> Executor:
    """The model in this process on one device, or a worker process per rank of the tensor-
    and pipeline-parallel world (``distributed_executor_backend="mp"``: a world of one too),
    or a Ray actor per rank (``"ray"``)."""
    if config.distributed_executor_backend == "ray":
        from tidal.gpu.ray_executor import RayExecutor

        return RayExecutor(config)
    if config.world_size > 1 or config.distributed_executor_backend == "mp":
        from tidal.gpu.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor(config)
    return UniProcExecutor(config)


class UniProcExecutor(Executor):
    """The ``ModelRunner`` in this process, called directly."""

    def __init__(self, config: EngineConfig) -> None:
        self.runner = runner = create_model_runner(config)
        self.max_model_len = runner.max_model_len
        self.vocab_size = runner.vocab_size
        self.eos_token_ids = runner.eos_token_ids
        self.attention_cost_context = runner.attention_cost_context
        self.model_config = runner.model_config
        self.dtype_name = str(runner.dtype).removeprefix("torch.")

    @property  # type: ignore[override]
    def profiler(self) -> StepProfiler:
        return self.runner.profiler

    @profiler.setter
    def profiler(self, profiler: StepProfiler) -> None:
        self.runner.profiler = profiler

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def host_blocks(self) -> int:
        return self.runner.host_tier.num_blocks if self.runner.host_tier else 0

    def disk_index(self) -> tuple[int, dict[int, bytes]]:
        return self.runner.disk_index()

    def apply_kv_copies(self, copies: KVCopies) -> None:
        self.runner.apply_kv_copies(copies)

    def take_kv_copy_timing(self) -> dict[str, tuple[int, float]]:
        copier = self.runner.kv_copier
        return copier.take_timing() if copier is not None else {}

    def execute_model_async(self, sched: SchedulerOutput,
                            before_forward: Callable[[], None] | None = None) -> StepResult:
        return self.runner.execute_model_async(sched, before_forward)

    def step_modes(self) -> contextlib.AbstractContextManager[None]:
        return self.runner.step_modes()

    def release_host_memory(self) -> None:
        release_freed_host_memory()

    def kernel_summary(self) -> str:
        return self.runner.kernel_summary()

    def shutdown(self) -> None:
        self.runner.shutdown()
