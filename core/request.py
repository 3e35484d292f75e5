"""A request as the engine sees it: token ids, counters and lifecycle status."""

from __future__ import annotations

import enum
import sys
import time
from dataclasses import dataclass, field

from tidal.core.lifecycle import RequestTimes
from tidal.core.prompt_logprobs import PromptScores
from tidal.core.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Every finished state orders after PREEMPTED."""

    WAITING = enum.auto()
    WAITING_FOR_GRAMMAR = enum.auto()  # queued while its structured-output grammar compiles
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self > _LAST_UNFINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


# A module constant: looking a member up on the enum class costs about 0.1 us, and this is
# asked several times per request per step.
_LAST_UNFINISHED = RequestStatus.PREEMPTED
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class Request:
    """One sequence to generate. ``n > 1`` is expanded into several requests upstream.

    ``num_tokens`` counts prompt + output tokens; ``num_computed_tokens`` counts those whose
    KV is in the cache. Their difference is what the scheduler still has to run.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit on first schedule; -1 until scheduled
    num_output_placeholders: int = 0  # tokens sampled by steps still in flight (async)
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    error: str | None = None
    client: str = ""  # who sent it: the scheduler takes waiting requests round-robin by client
    priority: int = 0  # under the priority policy, the lower the sooner (vLLM's meaning)
    times: RequestTimes = field(init=False, repr=False)  # its lifecycle, stamped as it goes

    def __post_init__(self) -> None:
        self.times = RequestTimes(self.arrival_time)
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.block_hashes: list[bytes] = []  # hashes of this request's full blocks
        # Counters kept as attributes, not properties over the lists: the scheduler reads
        # them several times per request per step.
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_output_tokens = len(self.output_token_ids)
        self.num_tokens = len(self.all_token_ids)
        self.last_scheduled = 0.0  # the scheduler's clock at its latest step
        params = self.sampling_params
        stops = set(params.stop_token_ids)
        if self.eos_token_id is not None and not params.ignore_eos:
            stops.add(self.eos_token_id)
        self.stop_token_set = frozenset(stops)  # ids that finish it once past min_tokens
        # the scheduler caps it by the model's context as well
        self.max_output_tokens = params.max_tokens if params.max_tokens is not None else sys.maxsize
        # its prompt's logprobs, gathered chunk by chunk, when it asks for them
        self.prompt_scores = (PromptScores(self.num_prompt_tokens)
                              if params.prompt_logprobs is not None else None)
        self.pooled: list[float] | None = None  # its embedding, when it pools (core/pooling.py)

    @property
    def is_finished(self) -> bool:
        return self.status > _LAST_UNFINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.num_output_tokens += 1
        self.num_tokens += 1
