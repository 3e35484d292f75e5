"""What the sampler needs to know about the rows of a step."""

from __future__ import annotations


def build_sampling_metadata(batch, states, vocab_size, device) -> int | None:
    """The largest top-N logprobs asked for, or None."""
    ns = [s.params.logprobs for s in states if s.params.logprobs is not None]
    return max(ns) if ns else None
