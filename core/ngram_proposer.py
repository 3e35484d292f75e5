"""Speculative decoding's configuration and its first proposer, n-gram prompt lookup.

The proposer finds the most recent earlier occurrence of a request's last ``n`` tokens (its
prompt and output so far), trying ``n`` from ``prompt_lookup_max`` down to
``prompt_lookup_min``, and proposes the tokens that followed it. The target model verifies the
proposals in its next step (docs/speculative-decoding.md), so a wrong guess costs compute,
never correctness.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

SPECULATIVE_METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``--speculative-config`` shape; only the ``ngram`` method so far."""

    method: str = "ngram"
    num_speculative_tokens: int = 4  # most proposed tokens per request and step (k)
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported; tidal "
                             f"has {', '.join(SPECULATIVE_METHODS)} (prompt lookup)")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative {name} must be a positive integer, "
                                 f"got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative prompt_lookup_min ({self.prompt_lookup_min}) is "
                             f"above prompt_lookup_max ({self.prompt_lookup_max})")


def parse_speculative_config(value: SpeculativeConfig | dict[str, Any] | str | None
                             ) -> SpeculativeConfig | None:
    """A config from a dict, its JSON text (the command line's) or a config; None stays."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative config is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative config must be a JSON object, got {value!r}")
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"speculative config has unknown keys {unknown}; tidal reads "
                         f"{sorted(known)}")
    if "method" not in value:
        raise ValueError("speculative config needs a method (\"ngram\")")
    return SpeculativeConfig(**value)


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
