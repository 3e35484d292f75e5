"""The two messages between the scheduler and the model runner, one of each per step."""

from __future__ import annotations

from dataclasses import dataclass, field

from core.outputs import TokenLogprobs
from core.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (or has dropped, after a preemption): sent in full."""

    req_id: str
    token_ids: list[int]  # prompt + outputs so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    seed: int | None  # per-request generator seed (the sampling seed, offset for n > 1)
    eos_token_id: int | None = None  # masked with stop_token_ids while below min_tokens


@dataclass
class CachedRequestData:
    """A request already in the runner's persistent batch: only what changed."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # in batch order: running requests first
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)  # to drop from the batch
    preempted_req_ids: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """Tokens sampled in one step, for the requests whose whole known context was computed."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs]] | None = None  # per request, per token

    @staticmethod
    def empty() -> ModelRunnerOutput:
        return ModelRunnerOutput([], [])
