"""Speculative decoding's n-gram (prompt lookup) proposer.

The proposer finds the most recent earlier occurrence of a request's last ``n`` tokens (its
prompt and output so far), trying ``n`` from ``prompt_lookup_max`` down to
``prompt_lookup_min``, and proposes the tokens that followed it. The target model verifies the
proposals in its next step (docs/speculative-decoding.md), so a wrong guess costs compute,
never correctness.
"""

from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: list[int] | np.ndarray, k: int, n_min: int, n_max: int
                  ) -> list[int]:
    """Up to ``k`` tokens following the most recent earlier match of the last ``n`` tokens of
    ``token_ids`` (the longest ``n`` in ``[n_min, n_max]`` that matches); [] if none does."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    total = tokens.size
    if k <= 0 or total < n_min + 1:
        return []
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        start = _latest_match(tokens, n)
        if start >= 0:
            follow = tokens[start + n:start + n + k]
            return follow.tolist()
    return []


def _latest_match(tokens: np.ndarray, n: int) -> int:
    """The start of the latest window of ``n`` tokens before the last ``n`` equal to them;
    -1 if there is none."""
    total = tokens.size
    # windows starting at 0 .. total - n - 1: the suffix itself is not one
    windows = np.lib.stride_tricks.sliding_window_view(tokens[:total - 1], n)
    hits = np.nonzero((windows == tokens[total - n:]).all(axis=1))[0]
    return int(hits[-1]) if hits.size else -1
