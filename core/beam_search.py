"""Beam search as HF transformers' ``generate(num_beams=...)`` does it, over the engine.

The search is plain bookkeeping: each round it asks for the top-k next-token logprobs of every
running beam (one one-token request per beam, ``logprobs=k``), keeps the best continuations
across beams, moves those that end (an end-of-sequence token, or the length limit) to the
finished hypotheses with their length-penalised score, and stops when HF's rules say no
running beam can improve on them. Each beam's request reads its prefix from the paged cache:
with prefix caching on, beams share the blocks of their common prefix and only the last
partial block is computed again. ``BeamSearch`` holds no engine: ``LLM.beam_search`` and the
server drive it.

The rules are HF's (transformers' ``_beam_search``): ``beams_to_keep`` = max(2, 1 + number of
EOS ids) x width candidates a round; a finished hypothesis' score is its summed logprob over
(generated length) ** ``length_penalty``; ``early_stopping`` True stops once ``width``
hypotheses are done, False stops when the best running beam at its current length cannot beat
the worst finished one, "never" (with a positive penalty) measures that at the longest length.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from tidal.core.outputs import TokenLogprobs

NEG = -1.0e9  # HF's "never chosen" score
MAX_BEAM_WIDTH = 10  # 2 x width logprobs a beam a round, within the engine's 20


@dataclass
class BeamSearchParams:
    """vLLM's and HF's knobs: ``beam_width`` beams (and as many returned), ``max_tokens`` new
    tokens at most."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never"

    def __post_init__(self) -> None:
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be in 1..{MAX_BEAM_WIDTH}, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be true, false or 'never', got "
                             f"{self.early_stopping!r}")


@dataclass
class BeamSequence:
    """A returned beam: its new tokens, summed logprob and length-penalised score."""

    tokens: list[int]
    cum_logprob: float
    score: float
    finish_reason: str  # "stop" (an EOS) or "length"
    text: str = ""


@dataclass
class _Candidate:
    tokens: list[int]
    cum_logprob: float
    ends: bool = False


@dataclass
class BeamSearch:
    """One prompt's search. ``requests()`` gives the token sequences (prompt + beam) whose
    next-token logprobs the next round needs; ``advance()`` takes them (one dict per
    sequence, at least ``top_k`` entries each) in that order; ``done`` then ``results()``."""

    prompt: list[int]
    params: BeamSearchParams
    eos_token_ids: list[int]
    running: list[_Candidate] = field(default_factory=list)
    finished: list[tuple[float, _Candidate]] = field(default_factory=list)
    done: bool = False
    _improvable: bool = True

    def __post_init__(self) -> None:
        self.running = [_Candidate([], 0.0)]
        eos = [] if self.params.ignore_eos else self.eos_token_ids
        self._eos = set(eos)
        self.top_k = max(2, 1 + len(eos)) * self.params.beam_width

    @property
    def generated(self) -> int:
        return len(self.running[0].tokens)

    def requests(self) -> list[list[int]]:
        return [self.prompt + beam.tokens for beam in self.running]

    def advance(self, next_logprobs: list[TokenLogprobs]) -> None:
        width, length = self.params.beam_width, self.generated + 1
        pool = [_Candidate(beam.tokens + [token], beam.cum_logprob + lp)
                for beam, options in zip(self.running, next_logprobs)
                for token, lp in options.items()]
        top = heapq.nlargest(self.top_k, pool, key=lambda c: c.cum_logprob)
        for candidate in top:
            candidate.ends = (candidate.tokens[-1] in self._eos
                              or length >= self.params.max_tokens)
        self._finish(top[:width], length)
        self.running = heapq.nlargest(width, (c for c in top if not c.ends),
                                      key=lambda c: c.cum_logprob)
        self._improvable = self._improvable and self._may_improve(length)
        full = len(self.finished) == width
        self.done = (not self._improvable or (full and self.params.early_stopping is True)
                     or not self.running)

    def _finish(self, best: list[_Candidate], length: int) -> None:
        """The ending candidates among the round's best ``width`` join the finished
        hypotheses, unless HF's rules close the door to new ones."""
        width = self.params.beam_width
        if not self._improvable or (len(self.finished) == width
                                    and self.params.early_stopping is True):
            return
        for candidate in best:
            if candidate.ends:
                score = candidate.cum_logprob / (length ** self.params.length_penalty)
                self.finished.append((score, candidate))
        self.finished = heapq.nlargest(width, self.finished, key=lambda f: f[0])

    def _may_improve(self, length: int) -> bool:
        """Whether the best running beam could still beat the worst finished hypothesis."""
        if not self.running:
            return False
        if len(self.finished) < self.params.beam_width:
            return True
        penalty = self.params.length_penalty
        best_length = (self.params.max_tokens if self.params.early_stopping == "never"
                       and penalty > 0.0 else length)
        best = self.running[0].cum_logprob / (best_length ** penalty)
        return best > min(score for score, _ in self.finished)

    def results(self) -> list[BeamSequence]:
        """The finished hypotheses, best first."""
        return [BeamSequence(c.tokens, c.cum_logprob, score,
                             "stop" if c.tokens and c.tokens[-1] in self._eos else "length")
                for score, c in sorted(self.finished, key=lambda f: -f[0])]
