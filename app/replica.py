"""What routers in front of several replicas ask a replica (sglang-router, vllm-router):
its model and limits, its load, and a way to drop its prefix cache.

``/get_server_info`` carries the fields sglang-router reads when it registers a worker
(``model_path``, ``dp_size``, ``max_total_num_tokens``, ...) beside tidal's own engine
configuration; ``/get_load`` has sglang's shape (one entry per data-parallel rank, and a tidal
replica is one rank), ``/load`` vLLM's. docs/scaling.md describes each answer.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tidal.app.errors import ApiError
from tidal.app.handling import check_api_key, check_engine, get_state
from tidal.app.server_state import ServerState
from tidal.core.async_engine import EngineDeadError


async def server_info(request: Request) -> Response:
    state = get_state(request)
    check_api_key(request.headers, state)
    config = state.engine_config
    return JSONResponse({
        "model_id": state.served_model_name,
        "served_model_name": state.served_model_name,
        "model_path": state.settings.model_path,
        "tokenizer_path": _tokenizer_path(state),
        "version": _version(),
        "is_generation": True,
        "max_model_len": state.max_model_len,
        "context_length": state.context_tokens,
        "max_req_input_len": state.context_tokens - 1,
        "max_total_num_tokens": state.kv_capacity_tokens,
        "max_running_requests": state.max_num_seqs,
        "max_prefill_tokens": config.get("max_num_batched_tokens"),
        "page_size": config.get("block_size"),
        "dp_size": 1,  # one tidal process is one data-parallel rank
        "tp_size": config.get("tensor_parallel_size", 1),
        "pp_size": config.get("pipeline_parallel_size", 1),
        "engine_config": config,
        # what runs the model's ops now: it changes once a background upgrade (the CPU
        # kernels built, the plans timed) is swapped in
        "kernels": state.engine.core.executor.kernel_summary(),
    })


async def model_info(request: Request) -> Response:
    state = get_state(request)
    check_api_key(request.headers, state)
    hf = _hf_config(state.settings.model_path)
    return JSONResponse({
        "model_path": state.settings.model_path,
        "tokenizer_path": _tokenizer_path(state),
        "served_model_name": state.served_model_name,
        "is_generation": True,
        "model_type": hf.get("model_type"),
        "architectures": hf.get("architectures"),
        "max_model_len": state.max_model_len,
        "vocab_size": state.vocab_size,
    })


async def load(request: Request) -> Response:
    """vLLM's shape: the requests the replica holds, running or waiting."""
    stats = get_state(request).engine.stats
    return JSONResponse({"server_load": stats.num_running + stats.num_waiting})


async def get_load(request: Request) -> Response:
    """sglang's shape: one entry per data-parallel rank; ``num_tokens`` is the KV cache in
    use, in tokens."""
    state = get_state(request)
    stats = state.engine.stats
    used_blocks = stats.num_total_blocks - stats.num_free_blocks
    return JSONResponse([{
        "dp_rank": 0, "num_reqs": stats.num_running + stats.num_waiting,
        "num_waiting_reqs": stats.num_waiting,
        "num_tokens": used_blocks * state.engine_config.get("block_size", 1)}])


async def flush_cache(request: Request) -> Response:
    """Drop the prefix cache, on the engine thread. Blocks that running requests hold keep
    their prefixes (``flushed`` is then false); every idle block loses its own."""
    state = get_state(request)
    check_api_key(request.headers, state)
    check_engine(state)
    try:
        flushed = await state.engine.reset_prefix_cache()
    except EngineDeadError as exc:
        raise ApiError(503, f"The engine is not running: {exc}", code="engine_dead") from exc
    message = ("Prefix cache flushed." if flushed else
               "Prefix cache flushed but for the blocks of running requests.")
    return JSONResponse({"status": "ok", "flushed": flushed, "message": message})


def _tokenizer_path(state: ServerState) -> str:
    return state.engine_config.get("tokenizer") or state.settings.model_path


@functools.cache
def _version() -> str:
    from tidal.app.banner import package_version

    return package_version()


@functools.cache
def _hf_config(model_path: str) -> dict[str, Any]:
    """The model directory's ``config.json`` (nothing for a GGUF file)."""
    path = Path(model_path) / "config.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}
