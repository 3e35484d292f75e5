"""The two messages between the scheduler and the model runner, one of each per step."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tidal.core.host_tier import KVCopies
from tidal.core.outputs import TokenLogprobs
from tidal.core.prompt_logprobs import PromptLogprobsChunk
from tidal.core.sampling_params import SamplingParams


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
class GrammarBitmask:
    """The allowed next tokens of a step's constrained rows: bit ``t % 32`` of word ``t // 32``
    of a row is set when token ``t`` may come next. A request with speculative proposals has a
    row per logits row of its (``num_rows``), one after each proposal."""

    req_ids: list[str]
    bitmask: np.ndarray  # int32 [sum(num_rows), ceil(vocab / 32)]
    num_rows: list[int] | None = None  # rows per request in order; None: one each


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    # Blocks added to requests the runner already holds. Nothing else about them is sent: the
    # runner advances their computed tokens by ``num_scheduled_tokens`` itself.
    new_block_ids: dict[str, list[int]]
    num_scheduled_tokens: dict[str, int]  # in batch order: running requests first
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)  # to drop from the batch
    preempted_req_ids: set[str] = field(default_factory=set)
    structured_req_ids: list[str] = field(default_factory=list)  # constrained rows sampled
    grammar_bitmask: GrammarBitmask | None = None  # theirs, filled between schedule and sample
    # KV blocks to copy between the device cache and the host tier before the forward
    kv_copies: KVCopies | None = None
    # Speculative decoding: the tokens proposed for a decoding request, run after its last
    # known token in this step's forward and verified there (vLLM V1's name)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # the blocks added to the sliding-window layers' tables this step, new requests' whole
    # tables included (core/kv_window.py); empty for a model with one block group
    new_window_block_ids: dict[str, list[int]] = field(default_factory=dict)
    # speculative draft_model: whether the draft follows this step and guesses for the next
    # (off in a plain step: the draft catches up once a step speculates again)
    propose_drafts: bool = True

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """The tokens sampled in one step for each request whose whole known context was
    computed: one, or with speculative decoding its accepted proposals and the next."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]  # per request, in order
    logprobs: list[list[TokenLogprobs]] | None = None  # per request, one per token
    # the prompt positions this step scored, of the requests asking for prompt logprobs
    # (whether or not they sample)
    prompt_logprobs: dict[str, PromptLogprobsChunk] | None = None
    # runner "pooling": the embeddings of the requests whose prompt this step completed
    pooled: dict[str, list[float]] | None = None
    # speculative draft_model: the draft's proposals to follow each sampling request's new
    # tokens, for the scheduler to run in the next step
    draft_token_ids: dict[str, list[int]] | None = None

    @staticmethod
    def empty() -> ModelRunnerOutput:
        return ModelRunnerOutput([], [])
