"""Serving: load the model, then serve the API with hypercorn on uvloop.

The socket opens first and the model loads behind it: ``/health`` answers 503 until the engine
is up, then 200 (``app/loading.py``).
SIGINT/SIGTERM first stop the engine, which ends every in-flight stream with an error event
and ``[DONE]``, then let hypercorn close the connections.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from tidal.app.banner import startup_banner

if TYPE_CHECKING:
    from hypercorn.config import Config

    from tidal.app.server_state import ServerSettings
    from tidal.core.async_engine import AsyncEngine
    from tidal.core.config import EngineConfig

logger = logging.getLogger("tidal")
T = TypeVar("T")  # what run_event_loop's coroutine returns


def serve(args: argparse.Namespace) -> int:
    from tidal.app.guard import default_allowed_hosts
    from tidal.app.server_state import ServerSettings
    from tidal.core.config import DEFAULT_MODEL, DEFAULT_MODEL_NAME, EngineConfig

    try:
        config = EngineConfig(
            model=args.model or DEFAULT_MODEL, tokenizer=args.tokenizer, dtype=args.dtype,
            device=args.device,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory,
            kv_offload_size=args.kv_offload_size, kv_offload_path=args.kv_offload_path,
            kv_offload_disk_size=args.kv_offload_disk_size,
            kv_cache_dtype=args.kv_cache_dtype, gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=args.enable_prefix_caching, enforce_eager=args.enforce_eager,
            async_scheduling=args.async_scheduling, attention_backend=args.attention_backend,
            cpu_kernels=args.cpu_kernels, quantization=args.quantization,
            quantization_group_size=args.quantization_group_size,
            tensor_parallel_size=args.tensor_parallel_size, nnodes=args.nnodes,
            pipeline_parallel_size=args.pipeline_parallel_size,
            distributed_executor_backend=args.distributed_executor_backend,
            node_rank=args.node_rank, distributed_init_method=args.distributed_init_method,
            grammar_compile_timeout=args.grammar_compile_timeout,
            grammar_compile_workers=args.grammar_compile_workers,
            grammar_cache_bytes=args.grammar_cache_bytes,
            scheduling_policy=args.scheduling_policy, runner=args.runner,
            speculative_config=args.speculative_config)
    except ValueError as exc:
        print(f"tidal: error: {exc}", file=sys.stderr)
        return 2
    if config.node_rank > 0:
        return serve_workers_only(config)
    tracer = None
    if args.otlp_traces_endpoint:
        from tidal.app.tracing import otlp_tracer

        try:
            tracer = otlp_tracer(args.otlp_traces_endpoint)
        except RuntimeError as exc:  # the OpenTelemetry packages are missing
            print(f"tidal: error: {exc}", file=sys.stderr)
            return 2
    settings = ServerSettings(
        served_model_name=args.served_model_name or args.model or DEFAULT_MODEL_NAME,
        model_path=config.model,
        api_key=args.api_key, max_request_bytes=args.max_request_bytes,
        host=args.host, port=args.port, allowed_origins=args.allowed_origins,
        allowed_hosts=(args.allowed_hosts if args.allowed_hosts is not None
                       else default_allowed_hosts(args.host)),
        metrics_without_key=args.metrics_without_key,
        request_body_timeout=args.request_body_timeout,
        chat_template=args.chat_template, tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        request_timeout=args.request_timeout, enable_request_tracing=args.enable_request_tracing,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        max_prompts_per_request=args.max_prompts_per_request,
        max_request_tokens=args.max_request_tokens, max_tools=args.max_tools,
        max_waiting_seqs=args.max_waiting_seqs,
        max_waiting_seqs_per_client=args.max_waiting_seqs_per_client,
        fair_share_by=args.fair_share_by, scheduling_policy=args.scheduling_policy)
    return run_event_loop(_serve(config, settings, tracer))


def serve_workers_only(config: EngineConfig) -> int:
    """A node past the first: its workers (tensor-parallel ranks, pipeline stages), until they
    end."""
    from tidal.core.executor import run_worker_node

    logger.info("node %d of %d: this node's ranks run in worker processes, meeting at %s",
                config.node_rank, config.nnodes, config.distributed_init_method)
    return run_worker_node(config)


def _hypercorn_config(settings: ServerSettings) -> Config:
    from hypercorn.config import Config

    host, port = settings.host, settings.port
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")  # through our logging set-up
    config.graceful_timeout = 5.0
    config.keep_alive_timeout = KEEP_ALIVE_TIMEOUT_S  # an idle connection is closed
    # a websocket frame past the body limit is refused as it arrives, not after 16 MiB
    config.websocket_max_message_size = settings.max_request_bytes + 1024
    return config


# How long an idle connection (no request in flight; or one that has not sent its whole
# headers yet) is kept before hypercorn closes it. A slow body is the app's to time
# (--request-body-timeout, app/guard.py).
KEEP_ALIVE_TIMEOUT_S = 5.0


# how long a server whose engine died keeps answering (503 on /health, errors elsewhere)
# before it exits, so that clients and routers see why
DEAD_ENGINE_GRACE_S = 1.0


async def _serve(config: EngineConfig, settings: ServerSettings, tracer: Any = None) -> int:
    """Open the socket, load the model meanwhile (``/health`` answers 503 until it is up), then
    serve until a signal; 1 if the model failed to load or the engine died later."""
    from hypercorn.asyncio import serve

    from tidal.app.loading import LoadingGate
    from tidal.app.routes import build_app
    from tidal.core.async_engine import AsyncEngine
    from tidal.core.heap import freeze_startup_objects  # core's package imports torch

    gate = LoadingGate()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not on this platform or thread
            pass
    failed: list[BaseException] = []

    async def load() -> None:
        logger.info("loading %s on %s", config.model, config.device)
        try:  # the engine builds itself on its own thread; this one only waits for it
            engine = await asyncio.to_thread(AsyncEngine, config)
        except Exception as exc:
            logger.exception("the model failed to load")
            failed.append(exc)
            stop.set()
            return
        app = build_app(engine, settings, tracer)
        try:
            logger.info("%s", startup_banner(engine, settings))
        except Exception:  # a log line never stops the server
            logger.exception("the start-up banner failed")
        freeze_startup_objects()  # the model, modules and app live as long as the process
        await gate.open(app)
        watching.append(loop.create_task(watch_engine(engine)))

    watching: list[asyncio.Task] = []

    async def watch_engine(engine: AsyncEngine) -> None:
        """A dead engine (a lost worker) ends the server, a moment later."""
        while engine.is_alive or engine.error is None:
            await asyncio.sleep(0.1)
        if not stop.is_set():
            logger.error("the engine died (%s): exiting", engine.error)
            failed.append(engine.error)
            await asyncio.sleep(DEAD_ENGINE_GRACE_S)
            stop.set()

    async def shutdown_trigger() -> None:
        await stop.wait()
        logger.info("shutting down")
        await gate.close()  # stops the engine, which ends every stream with an error event

    loading = asyncio.create_task(load())
    try:
        await serve(gate, _hypercorn_config(settings), shutdown_trigger=shutdown_trigger)
    finally:
        loading.cancel()
        for task in watching:
            task.cancel()
    return 1 if failed else 0


def run_event_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on uvloop, the server's event loop (plain asyncio where
    uvloop is missing, as on Windows)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
