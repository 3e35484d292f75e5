"""This process's place in a tensor-parallel group, and the two collectives the model needs.

A worker process joins the group once (``init_tensor_parallel``) before it builds its model;
the model's layers read ``tensor_parallel()`` when they are built. A process that joins no
group (one device) is rank 0 of 1, and every collective is the identity. With pipeline
parallelism the world is ``stages x tensor-parallel size`` ranks, stage by stage: each stage's
ranks form a tensor-parallel group, and the process's stage (``gpu/pipeline.py``) is set
here too.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tidal.gpu.pipeline import PipelineStage, set_pipeline_stage


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed group of the collectives (None: the default)
    cpu_group: Any = None  # every rank's gloo group, for Python objects (the step plans)
    world_size: int = 1  # ranks in all, every pipeline stage's

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x``, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` side by side along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (of every stage)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def shard_size(self, n: int) -> int:
        """Each rank's part of ``n`` rows split as evenly as possible (the last part padded)."""
        return -(-n // self.size)


_STATE = TensorParallel()


def tensor_parallel() -> TensorParallel:
    return _STATE


def init_tensor_parallel(rank: int, size: int, init_method: str, device: str,
                         timeout_s: float = 300.0, pipeline_size: int = 1) -> TensorParallel:
    """Join the world of ``size x pipeline_size`` ranks at ``init_method`` (``tcp://host:port``
    or ``env://``): NCCL between GPUs, gloo between CPU processes (and for the step plans);
    this rank's tensor-parallel group is its stage's ``size`` ranks."""
    global _STATE
    backend = "gloo" if device == "cpu" else "nccl"
    timeout = datetime.timedelta(seconds=timeout_s)
    world = size * pipeline_size
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timeout)
    cpu_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo",
                                                                          timeout=timeout)
    group = dist.group.WORLD
    if pipeline_size > 1:  # every rank creates every stage's group, in the same order
        stages = [dist.new_group(list(range(s * size, (s + 1) * size)), timeout=timeout,
                                 backend=backend) for s in range(pipeline_size)]
        group = stages[rank // size]
    _STATE = TensorParallel(rank % size, size, group, cpu_group, world)
    set_pipeline_stage(PipelineStage(rank // size, pipeline_size, rank, size, cpu_group))
    return _STATE


def leave_tensor_parallel() -> None:
    global _STATE
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE = TensorParallel()
    set_pipeline_stage(PipelineStage())
