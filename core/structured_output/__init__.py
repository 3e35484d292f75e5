"""Constrained decoding: what a request asks its output to match (``params``), grammars
compiled off the engine thread with a cache (``compiler``), and the per-request matchers that
fill each step's token bitmask and advance with the sampled tokens (``manager``)."""

from tidal.core.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
