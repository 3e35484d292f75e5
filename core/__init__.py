"""tidal's engine logic: requests, scheduling, the KV block manager, the engine loop and the
offline ``LLM`` API. Plain Python: everything that touches tensors lives in ``gpu``."""

from tidal.core.config import DEFAULT_MODEL, EngineConfig
from tidal.core.llm import LLM
from tidal.core.outputs import CompletionOutput, RequestOutput, RequestOutputCollector
from tidal.core.request import Request, RequestStatus
from tidal.core.sampling_params import SamplingParams

__all__ = [
    "CompletionOutput",
    "DEFAULT_MODEL",
    "EngineConfig",
    "LLM",
    "Request",
    "RequestOutput",
    "RequestOutputCollector",
    "RequestStatus",
    "SamplingParams",
]
