"""tidal: a fast, streaming LLM inference server.

One package in four parts, each a folder of this repository: ``tidal.app`` (HTTP, websockets,
the command line), ``tidal.core`` (the engine's logic), ``tidal.gpu`` (everything that touches
tensors, on the CPU and the GPU) and ``tidal.templates`` (chat templates and the web page).
``from tidal import LLM, SamplingParams`` is the offline API; ``python -m tidal serve`` (or the
``tidal`` command) the server."""

import os

# torch puts every tensor of 2 MB or more on transparent huge pages when this is set before its
# first allocation (it reads it once): a CPU decode step streams each weight from memory, and
# streams it faster from huge pages (docs/cpu-backend.md, "Huge pages"). Set it to 0 to keep
# torch's default.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from tidal.core import (  # noqa: E402
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
