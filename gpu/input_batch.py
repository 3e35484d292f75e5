"""The model runner's persistent batch: per-request token ids and block tables kept in
preallocated host arrays, updated from the scheduler's diffs rather than rebuilt each step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tidal.core.sampling_params import SamplingParams
from tidal.core.scheduler_output import NewRequestData, SchedulerOutput
from tidal.gpu.sampling_metadata import needs_metadata

if TYPE_CHECKING:
    from tidal.gpu.sampling_metadata import RowSampling


@dataclass
class CachedRequestState:
    req_id: str
    row: int
    num_prompt_tokens: int
    num_tokens: int  # known tokens: prompt + sampled so far
    num_computed_tokens: int
    params: SamplingParams
    generator: torch.Generator | None
    num_blocks: int
    num_window_blocks: int = 0  # filled of the sliding-window layers' table, where kept
    num_pending: int = 0  # sampled by a step whose result has not reached the host yet
    eos_token_id: int | None = None
    sampling: RowSampling | None = None  # the sampler's view of params, built on first use
    # a draft model's KV holds this many of its first tokens (gpu/draft_runner.py); it lags
    # the target's through steps without proposals
    draft_len: int = 0
    # the keys of the full blocks the draft's KV holds for this request (``draft_len``'s),
    # None until the draft first follows it and checks what a prefix hit's blocks hold
    draft_keys: list[bytes] | None = None

    @property
    def num_outputs(self) -> int:
        """Output tokens so far, those still on the device included."""
        return self.num_tokens - self.num_prompt_tokens + self.num_pending


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int,
                 device: str, window_tables: bool = False) -> None:
        self.device = device
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        # The same memory as a memoryview: an id written through it skips numpy's indexing
        # machinery. Right after a forward (caches cold) a batch-32 step's ids took 9 us this
        # way and 24 us as one fancy-indexed assignment.
        self._token_ids_view = memoryview(self.token_ids)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        # the sliding-window layers' tables, where they keep blocks of their own
        # (core/kv_window.py); id 0, the null block, stands for a block left behind
        self.window_block_table = (np.zeros_like(self.block_table) if window_tables
                                   else None)
        self.states: dict[str, CachedRequestState] = {}
        # Generators of preempted seeded requests: resumed where they stopped, so a seed gives
        # the same tokens whether or not the request was preempted.
        self._parked_generators: dict[str, torch.Generator] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        # requests whose sampling needs metadata (not plain greedy, or logprobs): while there
        # are none, a step's metadata is built without looking at its rows
        self.num_needing_metadata = 0
        # requests asking for prompt logprobs: while there are none, a step looks for no
        # prompt positions to score (gpu/prompt_logprobs.py)
        self.num_prompt_logprobs = 0

    def update(self, sched: SchedulerOutput) -> None:
        """Apply a step's changes: requests gone, new ones, blocks added."""
        for req_id in sched.preempted_req_ids:
            self.remove(req_id, keep_generator=True)
        for req_id in sched.finished_req_ids:
            self.remove(req_id)
        for new in sched.scheduled_new_reqs:
            self.add(new)
        for req_id, block_ids in sched.new_block_ids.items():
            self.add_blocks(req_id, block_ids)
        for req_id, block_ids in sched.new_window_block_ids.items():
            self.add_window_blocks(req_id, block_ids)

    def add(self, new: NewRequestData) -> None:
        self.remove(new.req_id, keep_generator=True)  # a resumed request comes back in full
        row = self._free_rows.pop()
        n = len(new.token_ids)
        self.token_ids[row, :n] = new.token_ids
        self.block_table[row, :len(new.block_ids)] = new.block_ids
        generator = self._parked_generators.pop(new.req_id, None)
        if generator is None and new.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(new.seed)
        self.states[new.req_id] = CachedRequestState(
            req_id=new.req_id, row=row, num_prompt_tokens=new.num_prompt_tokens, num_tokens=n,
            num_computed_tokens=new.num_computed_tokens, params=new.sampling_params,
            generator=generator, num_blocks=len(new.block_ids), eos_token_id=new.eos_token_id)
        self.num_needing_metadata += needs_metadata(new.sampling_params)
        self.num_prompt_logprobs += new.sampling_params.prompt_logprobs is not None

    def add_blocks(self, req_id: str, block_ids: list[int]) -> None:
        state = self.states[req_id]
        k = len(block_ids)
        self.block_table[state.row, state.num_blocks:state.num_blocks + k] = block_ids
        state.num_blocks += k

    def add_window_blocks(self, req_id: str, block_ids: list[int]) -> None:
        assert self.window_block_table is not None
        state = self.states[req_id]
        k = len(block_ids)
        self.window_block_table[state.row, state.num_window_blocks:state.num_window_blocks + k] \
            = block_ids
        state.num_window_blocks += k

    def remove(self, req_id: str, keep_generator: bool = False) -> None:
        """Drop a request's row; ``keep_generator`` parks its generator for its return."""
        state = self.states.pop(req_id, None)
        if state is not None:
            self._free_rows.append(state.row)
            self.num_needing_metadata -= needs_metadata(state.params)
            self.num_prompt_logprobs -= state.params.prompt_logprobs is not None
            if keep_generator and state.generator is not None:
                self._parked_generators[req_id] = state.generator
        if not keep_generator:
            self._parked_generators.pop(req_id, None)

    def append_tokens(self, states: list[CachedRequestState],
                      token_ids: list[list[int]]) -> None:
        """Record the tokens a launched step sampled, a list per state (one token, or
        accepted proposals and one more), each state's pending count going down; a state
        finished or preempted while its step ran only drops the count."""
        live = self.states
        tokens = self._token_ids_view
        for state, ids in zip(states, token_ids):
            state.num_pending -= 1
            if live.get(state.req_id) is state:
                for token_id in ids:
                    tokens[state.row, state.num_tokens] = token_id
                    state.num_tokens += 1

    def prompt_token_ids(self, state: CachedRequestState) -> np.ndarray:
        return self.token_ids[state.row, :state.num_prompt_tokens]
