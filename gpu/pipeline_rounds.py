"""Micro-batches in flight through the pipeline stages, as every rank runs them.

The engine keeps up to one step per stage in flight, each of requests that no other step in
flight holds (``core/micro_batches.py``). Every rank takes the same calls in the same order
(rank 0 broadcasts them), and counts the same *rounds*: a step enters the pipe in the round of
its call, stage ``s`` runs its forward ``s`` rounds later, and in the round the last stage
runs it its sampled tokens are broadcast to every rank (``PipelineStage.share_output``) and
rank 0 answers it. So in one round stage 0 runs the newest step while the last stage runs the
step ``N - 1`` calls older: every stage works at once.

Why this order cannot wait on itself: a stage receives a step's activations in the round after
the stage before it started sending them (``dist.isend``, not waited for until the step is
shared), and the round's broadcasts (the call, the shared tokens) are joined by every rank
after work that only needs earlier rounds' sends. A stage before the last applies a step's
tokens to its persistent batch when they are shared, before it next runs those requests (the
engine never puts a request in two steps in flight).

Anything else than a step with work (an empty step, a call such as ``apply_kv_copies``, the
executor's ``drain``) first runs rounds without a new step until the pipe is empty, then runs
as it would without stages; the answers stay in the calls' order.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tidal.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from tidal.gpu.model_runner import ModelRunner
from tidal.gpu.pipeline import PipelineStage, take_tokens


@dataclass
class _InFlight:
    sched: SchedulerOutput
    entered: int  # the round of its call
    handle: Any = None  # this stage's launch, once run (the last stage's holds the tokens)
    sends: list[Any] = field(default_factory=list)  # its activations on their way on


class StepRounds:
    """The steps in this rank's pipe, and the rounds that move them through the stages."""

    def __init__(self, runner: ModelRunner, stage: PipelineStage) -> None:
        self.runner, self.stage = runner, stage
        self.steps: deque[_InFlight] = deque()
        self.round = 0

    def step(self, sched: SchedulerOutput) -> list[ModelRunnerOutput]:
        """Take a step with work into the pipe and run a round; the outputs of the steps
        that round finished (none, or the one ``N - 1`` calls older), oldest first."""
        self.steps.append(_InFlight(sched, self.round))
        return self._round()

    def drain(self) -> list[ModelRunnerOutput]:
        """Run rounds without a new step until every step in the pipe is finished."""
        outputs = []
        while self.steps:
            outputs += self._round()
        return outputs

    def _round(self) -> list[ModelRunnerOutput]:
        now, stage = self.round, self.stage
        self.round += 1
        for step in self.steps:  # in a round at most one step becomes this stage's
            if step.handle is None and now - step.entered >= stage.index:
                step.handle = self.runner.execute_model_async(step.sched)
                step.sends = stage.take_sends()
        outputs = []
        while self.steps and now - self.steps[0].entered >= stage.size - 1:
            outputs.append(self._share(self.steps.popleft()))
        return outputs

    def _share(self, step: _InFlight) -> ModelRunnerOutput:
        """The step's tokens, from the last stage to every rank; a stage before the last
        takes them into its batch."""
        stage = self.stage
        out = stage.share_output(step.handle.result() if stage.is_last else None)
        for work, _ in step.sends:  # long received: the next stage ran this step
            work.wait()
        if not stage.is_last:
            take_tokens(self.runner.batch, out)
        return out
