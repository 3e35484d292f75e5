"""``--speculative-config``: vLLM's JSON shape, checked (docs/speculative-decoding.md).

Two methods: ``ngram`` (prompt lookup over the request's own tokens, ``core/ngram_proposer.py``)
and ``suffix`` (suffix decoding over the request and the outputs of recent requests,
``core/suffix_proposer.py``). Each reads its own keys; the others keep their defaults.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

SPECULATIVE_METHODS = ("ngram", "suffix")
_POSITIVE_INTS = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                  "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``--speculative-config`` keys for the ``ngram`` and ``suffix`` methods."""

    method: str = "ngram"
    num_speculative_tokens: int = 4  # most proposed tokens per request and step (k)
    prompt_lookup_min: int = 2  # ngram: the shortest suffix matched
    prompt_lookup_max: int = 5  # ngram: the longest
    # suffix: the longest context matched and the longest path proposed
    suffix_decoding_max_tree_depth: int = 24
    # suffix: finished requests whose outputs are searched (the oldest dropped first)
    suffix_decoding_max_cached_requests: int = 1000
    # suffix: at most this many proposals per token of the matched context
    suffix_decoding_max_spec_factor: float = 1.0
    # suffix: a path is proposed while its estimated probability stays at least this
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported; tidal "
                             f"has {', '.join(SPECULATIVE_METHODS)}")
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative {name} must be a positive integer, "
                                 f"got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative prompt_lookup_min ({self.prompt_lookup_min}) is "
                             f"above prompt_lookup_max ({self.prompt_lookup_max})")
        factor, prob = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if not _is_number(factor) or factor <= 0:
            raise ValueError("speculative suffix_decoding_max_spec_factor must be a positive "
                             f"number, got {factor!r}")
        if not _is_number(prob) or not 0 <= prob <= 1:
            raise ValueError("speculative suffix_decoding_min_token_prob must be in [0, 1], "
                             f"got {prob!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def parse_speculative_config(value: SpeculativeConfig | dict[str, Any] | str | None
                             ) -> SpeculativeConfig | None:
    """A config from a dict, its JSON text (the command line's) or a config; None stays.
    ``suffix`` without ``num_speculative_tokens`` proposes up to its tree depth (vLLM's
    default)."""
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
        raise ValueError("speculative config needs a method (\"ngram\" or \"suffix\")")
    if value["method"] == "suffix" and "num_speculative_tokens" not in value:
        value = {**value, "num_speculative_tokens": value.get(
            "suffix_decoding_max_tree_depth", SpeculativeConfig.suffix_decoding_max_tree_depth)}
    return SpeculativeConfig(**value)
