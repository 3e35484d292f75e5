"""Where each finished request's lifecycle goes: the phase histograms always, a JSON log line
with ``--enable-request-tracing``, and OpenTelemetry spans with ``--otlp-traces-endpoint``.

All of them run on the event loop, fed by ``AsyncEngine.finished_listeners`` from the engine's
stamps (``core/lifecycle.py``), aborted and timed-out requests included.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tidal.app.server_state import ServerState
    from tidal.core.async_engine import AsyncEngine
    from tidal.core.lifecycle import RequestStats

trace_logger = logging.getLogger("tidal.trace")
OTLP_PACKAGES = "opentelemetry-sdk opentelemetry-exporter-otlp-proto-http"


def install(engine: AsyncEngine, state: ServerState, tracer: Any = None) -> None:
    """Feed ``engine``'s finished requests to the metrics, and to the trace log and the spans
    when the settings ask for them (``tracer``: an OpenTelemetry tracer to use instead of one
    exporting to ``--otlp-traces-endpoint``)."""
    settings = state.settings
    model = state.served_model_name
    engine.finished_listeners.append(state.metrics.observe_finished)
    if settings.enable_request_tracing:
        engine.finished_listeners.append(lambda stats: log_trace(stats, model))
    if tracer is None and settings.otlp_traces_endpoint:
        tracer = otlp_tracer(settings.otlp_traces_endpoint)
    if tracer is not None:
        engine.finished_listeners.append(lambda stats: emit_spans(tracer, stats, model))


def trace_record(stats: RequestStats, model: str) -> dict[str, Any]:
    """One finished request as the trace log writes it: its phases in order, in milliseconds
    from its arrival, and what it cost."""
    start = stats.times.arrival
    intervals = {"queue": stats.queue_time, "prefill": stats.prefill_time,
                 "decode": stats.decode_time, "inference": stats.inference_time}
    return {
        "request_id": stats.request_id, "model": model, "finish_reason": stats.finish_reason,
        "timed_out": stats.timed_out,
        "arrival_unix": round(_to_unix(start), 6),
        "phases": [[name, round((at - start) * 1e3, 3)] for name, at in stats.phases()],
        "ms": {name: None if v is None else round(v * 1e3, 3) for name, v in intervals.items()},
        "prompt_tokens": stats.num_prompt_tokens,
        "generation_tokens": stats.num_generation_tokens,
        "cached_tokens": stats.num_cached_tokens, "steps": stats.times.num_steps,
        "preemptions": stats.num_preemptions,
    }


def log_trace(stats: RequestStats, model: str) -> None:
    trace_logger.info("%s", json.dumps(trace_record(stats, model), separators=(",", ":")))


# -- OpenTelemetry ----------------------------------------------------------------------------
def otlp_tracer(endpoint: str) -> Any:
    """A tracer whose spans go, in batches, to the OTLP/HTTP collector at ``endpoint``
    (e.g. ``http://127.0.0.1:4318/v1/traces``)."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise RuntimeError(f"--otlp-traces-endpoint needs the OpenTelemetry SDK and its OTLP "
                           f"exporter: pip install {OTLP_PACKAGES} ({exc})") from None
    provider = TracerProvider(resource=Resource.create({"service.name": "tidal"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider.get_tracer("tidal")


# child spans of the request's span: (name, start stamp, end stamp)
SPAN_PHASES = (("tokenize", "arrival", "tokenized"), ("queue", "queued", "scheduled"),
               ("prefill", "scheduled", "first_token"), ("decode", "first_token", "last_token"))


def emit_spans(tracer: Any, stats: RequestStats, model: str) -> None:
    """The request as a span from its arrival to its end, with vLLM's ``gen_ai.*``
    attributes, a child span per phase, and an event per preemption and resumption."""
    from opentelemetry.trace import SpanKind, set_span_in_context

    times = stats.times
    offset = _unix_offset()

    def ns(at: float) -> int:
        return int((at + offset) * 1e9)

    latency = {"time_in_queue": stats.queue_time, "time_in_model_prefill": stats.prefill_time,
               "time_in_model_decode": stats.decode_time,
               "time_in_model_inference": stats.inference_time,
               "time_to_first_token": _between(times.arrival, times.first_token),
               "e2e": _between(times.arrival, times.finished)}
    attributes: dict[str, Any] = {
        "gen_ai.request.id": stats.request_id, "gen_ai.response.model": model,
        "gen_ai.response.finish_reasons": [stats.finish_reason or ""],
        "gen_ai.usage.prompt_tokens": stats.num_prompt_tokens,
        "gen_ai.usage.completion_tokens": stats.num_generation_tokens,
        "tidal.cached_tokens": stats.num_cached_tokens, "tidal.steps": times.num_steps,
        "tidal.preemptions": stats.num_preemptions, "tidal.timed_out": stats.timed_out,
        **{f"gen_ai.latency.{k}": v for k, v in latency.items() if v is not None}}
    root = tracer.start_span("llm_request", kind=SpanKind.SERVER, attributes=attributes,
                             start_time=ns(times.arrival))
    for name, at in times.events:
        root.add_event(name, timestamp=ns(at))
    context = set_span_in_context(root)
    for name, start, end in SPAN_PHASES:
        begin, until = getattr(times, start), getattr(times, end)
        if begin is not None and until is not None:
            tracer.start_span(name, context=context, start_time=ns(begin)).end(end_time=ns(until))
    root.end(end_time=ns(times.finished or times.arrival))


def _between(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


def _unix_offset() -> float:
    """What to add to a ``time.monotonic`` stamp to get Unix time."""
    return time.time() - time.monotonic()


def _to_unix(monotonic: float) -> float:
    return monotonic + _unix_offset()
