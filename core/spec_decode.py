"""The scheduler's side of speculative decoding: which decoding requests get proposals and how
many, and the bookkeeping once the target has verified them (docs/speculative-decoding.md).

Proposed tokens are counted as computed when scheduled, like any scheduled token; those the
target rejects are taken back after the step (``settle``), so their KV slots are written
again by the next step. The KV cache manager registers only blocks full of known tokens for
prefix hits, never one holding a proposal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tidal.core.ngram_proposer import propose_ngram
from tidal.core.request import Request
from tidal.core.spec_mode import StepModes
from tidal.core.spec_policy import SpecPolicy
from tidal.core.speculative_config import SpeculativeConfig
from tidal.core.suffix_proposer import SuffixProposer

if TYPE_CHECKING:
    from tidal.core.structured_output.manager import StructuredOutputManager


@dataclass
class SpecDecodeStats:
    """vLLM's counters: runs of proposals verified (``spec_decode_num_drafts``), tokens proposed
    (``spec_decode_num_draft_tokens``), of those the target accepted
    (``spec_decode_num_accepted_tokens``) and at each position of a run
    (``..._per_pos``); and the proposals dropped because they would not pay."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    num_trimmed_tokens: int = 0


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 structured: StructuredOutputManager | None = None,
                 async_scheduling: bool = False) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.structured = structured  # constrained requests' matchers check their proposals
        self.suffix = (SuffixProposer(config.suffix_decoding_max_tree_depth,
                                      config.suffix_decoding_max_cached_requests,
                                      config.suffix_decoding_max_spec_factor,
                                      config.suffix_decoding_min_token_prob)
                       if config.method == "suffix" else None)
        self.stats = SpecDecodeStats()
        self.policy = SpecPolicy()  # how many proposals pay, by measurement
        # the engine says each step whether it speculates, as measured to pay
        # (core/spec_mode.py); a seeded sampling request then never does, so its tokens do
        # not depend on which steps did
        self.modes = StepModes()
        self.active = True
        self.async_scheduling = async_scheduling
        self._in_step: dict[str, int] = {}  # request id -> proposals in the step running
        # draft_model: request id -> (its known tokens when proposed, the draft's proposals),
        # from the step that sampled its last token (``ModelRunnerOutput.draft_token_ids``)
        self._drafted: dict[str, tuple[int, list[int]]] = {}

    def propose(self, request: Request, budget: int, num_rows: int = 1) -> list[int]:
        """Proposals for a decoding ``request`` (its known tokens all computed after this
        step's one), within ``budget - 1`` more tokens, as many as pay in a step of about
        ``num_rows`` rows (``core/spec_policy.py``; a seeded request keeps them all: its
        random draws, and so its tokens, depend on its proposals). None for a request still
        prefilling (its last prompt token included). A constrained request's proposals are cut
        at the first its grammar refuses, so each proposed position has a bitmask to verify
        with."""
        params = request.sampling_params
        if not (request.num_output_tokens and self.active) or (
                params.seed is not None and not params.greedy and self.steps_vary):
            return []
        cfg = self.config
        k = min(cfg.num_speculative_tokens, budget - 1,
                request.max_output_tokens - request.num_output_tokens - 1,
                self.max_model_len - request.num_tokens - 1)
        if k <= 0:
            return []
        if self.suffix is not None:
            drafts = self.suffix.propose(request.request_id, request.all_token_ids, k)
        elif cfg.method == "draft_model":
            drafts = self._draft_for(request, k)
        else:
            drafts = propose_ngram(request.all_token_ids, k, cfg.prompt_lookup_min,
                                   cfg.prompt_lookup_max)
        if params.seed is None:  # a seed replays only the same proposals
            kept = self.policy.keep(request.request_id, len(drafts), num_rows)
            self.stats.num_trimmed_tokens += len(drafts) - kept
            drafts = drafts[:kept]
        if drafts and params.structured_outputs is not None:
            if self.structured is None:
                return []
            drafts = self.structured.allowed_prefix(request.request_id, drafts)
        return drafts

    @property
    def steps_vary(self) -> bool:
        """Whether some steps may run without proposals: chosen by measurement, or with async
        scheduling (whose steps without the step in flight processed have none)."""
        return self.async_scheduling or self.modes.forced is not True

    def drafted(self, request: Request, drafts: list[int]) -> None:
        """The draft model proposed ``drafts`` to follow ``request``'s known tokens."""
        self._drafted[request.request_id] = (request.num_tokens, drafts)

    def _draft_for(self, request: Request, k: int) -> list[int]:
        """The draft's proposals for ``request``, if made after its current last token."""
        num_tokens, drafts = self._drafted.pop(request.request_id, (-1, []))
        return drafts[:k] if num_tokens == request.num_tokens else []

    def scheduled(self, request: Request, drafts: list[int]) -> None:
        """``drafts`` run for ``request`` in this step."""
        self._in_step[request.request_id] = len(drafts)
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += len(drafts)

    def settle(self, request: Request, num_sampled: int) -> None:
        """The step gave ``request`` ``num_sampled`` tokens (accepted proposals and one
        more): the rejected proposals are no longer computed."""
        k = self._in_step.pop(request.request_id, 0)
        if not k:
            return
        accepted = num_sampled - 1
        self.stats.num_accepted_tokens += accepted
        per_pos = self.stats.accepted_per_pos
        per_pos += [0] * (accepted - len(per_pos))
        for i in range(accepted):
            per_pos[i] += 1
        self.policy.settled(request.request_id, k, accepted)
        request.num_computed_tokens -= k + 1 - num_sampled

    def finished(self, request: Request) -> None:
        """``request`` is done (stopped, aborted or failed): what it held goes, and suffix
        decoding keeps its output for the requests after it."""
        self._in_step.pop(request.request_id, None)
        self._drafted.pop(request.request_id, None)
        self.policy.finished(request.request_id)
        if self.suffix is not None:
            self.suffix.finished(request.request_id, request.output_token_ids)

    def observe_step(self, num_rows: int, seconds: float) -> None:
        """A step of ``num_rows`` rows took ``seconds``: the cost model's data."""
        self.policy.cost.observe(num_rows, seconds)

    def new_step(self) -> None:
        """A step is being scheduled: the last one's requests are settled (or finished)."""
        self._in_step.clear()
