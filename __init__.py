"""tidal: a fast, streaming LLM inference server.

One package in four parts, each a folder of this repository: ``tidal.app`` (HTTP, websockets,
the command line), ``tidal.core`` (the engine's logic), ``tidal.gpu`` (everything that touches
tensors, on the CPU and the GPU) and ``tidal.templates`` (chat templates and the web page).
``from tidal import LLM, SamplingParams`` is the offline API; ``python -m tidal serve`` (or the
``tidal`` command) the server."""

from tidal.core import (
    DEFAULT_MODEL,
    LLM,
    CompletionOutput,
    EngineConfig,
    RequestOutput,
    SamplingParams,
)

__all__ = [
    "CompletionOutput",
    "DEFAULT_MODEL",
    "EngineConfig",
    "LLM",
    "RequestOutput",
    "SamplingParams",
]
