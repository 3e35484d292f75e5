"""tidal's engine logic: requests, scheduling, the KV block manager, the engine loop and the
offline ``LLM`` API. Plain Python: everything that touches tensors lives in ``gpu``."""

from core.config import DEFAULT_MODEL, EngineConfig
from core.llm import LLM
from core.outputs import CompletionOutput, RequestOutput, RequestOutputCollector
from core.request import Request, RequestStatus
from core.sampling_params import SamplingParams

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
