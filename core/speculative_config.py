"""``--speculative-config``: vLLM's JSON shape, checked (docs/speculative-decoding.md).

Three methods: ``ngram`` (prompt lookup over the request's own tokens, ``core/ngram_proposer.py``),
``suffix`` (suffix decoding over the request and the outputs of recent requests,
``core/suffix_proposer.py``) and ``draft_model`` (a small model with the target's vocabulary,
run by the model runner beside the target, ``gpu/draft_runner.py``). Each reads its own keys;
the others keep their defaults.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")
DEFAULT_DRAFT_DIR = "draft"  # the embedded model's draft, inside its folder
_POSITIVE_INTS = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                  "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``--speculative-config`` keys for the ``ngram``, ``suffix`` and ``draft_model``
    methods."""

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
    # draft_model: the draft's folder; None: the one shipped beside the target, if any
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported; tidal "
                             f"has {', '.join(SPECULATIVE_METHODS)}")
        if self.model is not None and self.method != "draft_model":
            raise ValueError(f"speculative \"model\" is for the draft_model method, not "
                             f"{self.method!r}")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative model must be a path, got {self.model!r}")
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
    if "method" not in value and "model" in value:  # vLLM's spelling of a draft model
        value = {**value, "method": "draft_model"}
    if "method" not in value:
        raise ValueError("speculative config needs a method (\"ngram\", \"suffix\" or "
                         "\"draft_model\")")
    if value["method"] == "suffix" and "num_speculative_tokens" not in value:
        value = {**value, "num_speculative_tokens": value.get(
            "suffix_decoding_max_tree_depth", SpeculativeConfig.suffix_decoding_max_tree_depth)}
    return SpeculativeConfig(**value)


def resolve_draft_model(config: SpeculativeConfig, target_model: str) -> str:
    """The draft model's folder: the config's ``model``, else the draft shipped inside the
    target's folder (the embedded model's, ``core/default_model/draft``)."""
    if config.model is not None:
        return config.model
    shipped = Path(target_model) / DEFAULT_DRAFT_DIR
    if (shipped / "config.json").is_file():
        return str(shipped)
    raise ValueError(f"speculative method draft_model needs a \"model\" (the draft's folder): "
                     f"{target_model!r} ships no draft in {DEFAULT_DRAFT_DIR}/")
