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
    ``token_ids`` (the longest ``n`` in ``[n_min, n_max]`` that matches); [] if none does.

    One pass over the tokens finds the earlier places of the last token; each longer ``n``
    only narrows those down (a window view per ``n`` cost several times as much, for every
    decoding request in every speculating step)."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    total = tokens.size
    if k <= 0 or total < n_min + 1:
        return []
    ends = np.flatnonzero(tokens[:total - 1] == tokens[total - 1])  # where a match could end
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        hits = ends[ends >= n - 1]
        for j in range(1, n):
            if not hits.size:
                break
            hits = hits[tokens[hits - j] == tokens[total - 1 - j]]
        if hits.size:
            follow = int(hits[-1]) + 1
            return tokens[follow:follow + k].tolist()
    return []
