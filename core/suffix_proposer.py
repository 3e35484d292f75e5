"""Suffix decoding's proposer (Oliaro et al., "SuffixDecoding", 2024; vLLM's ``suffix``
method): proposals from what followed the request's recent context before, in its own prompt
and output and in the outputs of recently finished requests.

Every earlier place where the request's last two tokens occurred is a candidate; each is
matched backwards against the request's context (up to ``max_tree_depth`` tokens), and the
candidates with the longest match are kept, as the deepest node of a suffix tree would keep
them. The proposal then follows the candidates token by token: each next token is the most
frequent among them, the candidates that disagree are dropped, and the path's estimated
probability (the product of each token's share) must stay at least ``min_token_prob``. A match
of ``L`` tokens proposes at most ``max_spec_factor * L`` tokens. The target verifies every
proposal, so a poor guess costs compute, never correctness.

Finished requests' outputs are kept for ``max_cached_requests`` requests (oldest out first),
indexed by their token pairs; a running request's own tokens are indexed as they arrive.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from dataclasses import dataclass, field

CANDIDATES = 32  # the most recent occurrences of the last two tokens looked at, per source

Pair = tuple[int, int]


@dataclass
class _Own:
    """A running request's tokens indexed by pair: pair -> positions of its second token."""

    positions: dict[Pair, list[int]] = field(default_factory=dict)
    indexed: int = 0  # tokens indexed so far

    def catch_up(self, tokens: list[int]) -> None:
        for p in range(max(1, self.indexed), len(tokens)):
            self.positions.setdefault((tokens[p - 1], tokens[p]), []).append(p)
        self.indexed = len(tokens)


class SuffixProposer:
    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 1000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1) -> None:
        self.max_depth = max_tree_depth
        self.max_cached = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._own: dict[str, _Own] = {}
        self._outputs: dict[int, list[int]] = {}  # cached output id -> its tokens
        self._index: dict[Pair, deque[tuple[int, int]]] = {}  # pair -> (output id, position)
        self._next_id = 0

    @property
    def num_cached(self) -> int:
        return len(self._outputs)

    def propose(self, req_id: str, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens likely to follow ``tokens`` (request ``req_id``'s prompt and
        output so far)."""
        if k <= 0 or len(tokens) < 3:
            return []
        own = self._own.setdefault(req_id, _Own())
        own.catch_up(tokens)
        pair = (tokens[-2], tokens[-1])
        last = len(tokens) - 1
        candidates = [(tokens, p) for p in itertools.islice(
            reversed(own.positions.get(pair, ())), 1, CANDIDATES + 1)]  # not the end itself
        candidates += [(self._outputs[i], p) for i, p in itertools.islice(
            reversed(self._index.get(pair, ())), CANDIDATES)]
        if not candidates:
            return []
        lengths = [_match_length(seq, p, tokens, last, self.max_depth)
                   for seq, p in candidates]
        longest = max(lengths)
        kept = [c for c, n in zip(candidates, lengths) if n == longest]
        limit = min(k, int(self.max_spec_factor * longest), self.max_depth)
        return self._follow(kept, limit)

    def _follow(self, kept: list[tuple[list[int], int]], limit: int) -> list[int]:
        """The most frequent path after the kept candidates, while its probability holds."""
        out: list[int] = []
        prob = 1.0
        for step in range(1, limit + 1):
            nexts = [seq[p + step] for seq, p in kept if p + step < len(seq)]
            if not nexts:
                break
            token, count = Counter(nexts).most_common(1)[0]
            prob *= count / len(kept)  # a candidate that ended counts against the path
            if prob < self.min_token_prob:
                break
            out.append(token)
            kept = [(seq, p) for seq, p in kept if p + step < len(seq) and seq[p + step] == token]
        return out

    def finished(self, req_id: str, output_token_ids: list[int]) -> None:
        """Request ``req_id`` is done: its index goes, its output joins the cache."""
        self._own.pop(req_id, None)
        if len(output_token_ids) < 3:
            return
        out_id, self._next_id = self._next_id, self._next_id + 1
        seq = list(output_token_ids)
        self._outputs[out_id] = seq
        for p in range(1, len(seq)):
            self._index.setdefault((seq[p - 1], seq[p]), deque()).append((out_id, p))
        while len(self._outputs) > self.max_cached:
            self._evict(next(iter(self._outputs)))

    def _evict(self, out_id: int) -> None:
        """Drop the oldest cached output: its entries are the first of each pair's deque."""
        seq = self._outputs.pop(out_id)
        for p in range(1, len(seq)):
            pair = (seq[p - 1], seq[p])
            entries = self._index.get(pair)
            while entries and entries[0][0] == out_id:
                entries.popleft()
            if entries is not None and not entries:
                del self._index[pair]


def _match_length(seq: list[int], p: int, tokens: list[int], last: int, depth: int) -> int:
    """How many tokens ending at ``seq[p]`` equal those ending at ``tokens[last]`` (at most
    ``depth``)."""
    n = 0
    while n < depth and p - n >= 0 and seq[p - n] == tokens[last - n]:
        n += 1
    return n
