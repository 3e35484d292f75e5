"""The start-up banner: what the server will do once the engine is up, and tidal's version."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidal.app.server_state import ServerSettings
    from tidal.core.async_engine import AsyncEngine


def package_version() -> str:
    """tidal's version: the installed package's, else the checkout's ``pyproject.toml``."""
    from importlib import metadata
    from pathlib import Path

    try:
        return metadata.version("tidal")
    except metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        found = re.search(r'^version = "([^"]+)"', pyproject.read_text(), re.M) \
            if pyproject.is_file() else None
        return found.group(1) if found else "unknown"



def base_url(settings: ServerSettings) -> str:
    """The URL a client on this machine reaches the server at: a wildcard bind address is
    reached at the loopback address."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(settings.host,
                                                                      settings.host)
    return f"http://[{host}]:{settings.port}" if ":" in host else f"http://{host}:{settings.port}"


def startup_banner(engine: AsyncEngine, settings: ServerSettings) -> str:
    """What the server will do, once the engine is up: the model, device, dtype, context,
    KV-cache capacity, batching, the kernels in use and the URLs."""
    from tidal.core.config import is_gguf_file

    core = engine.core
    config, executor = core.config, core.executor
    arch = executor.model_config
    tokens = core.kv.num_blocks * config.block_size
    url = base_url(settings)
    listen = (f" (listening on {settings.host or 'every address'}:{settings.port})"
              if settings.host in ("0.0.0.0", "::", "") else "")
    dtype = executor.dtype_name
    if config.quantization == "int8":
        dtype += ", decoder weights int8"
    elif config.quantization == "int4":
        dtype += f", decoder weights int4 (groups of {config.quantization_group_size})"
    elif is_gguf_file(config.model):
        dtype += ", decoder weights kept as the GGUF file quantizes them"
    lines = [
        f"tidal {package_version()} serving {settings.served_model_name}{listen}",
        f"  model     {config.model} ({arch.architecture}, {arch.num_layers} layers, "
        f"hidden {arch.hidden_size})",
        f"  device    {config.device}, {dtype}",
        f"  context   {core.max_model_len:,} tokens a request (prompt and reply)",
        f"  KV cache  {tokens:,} tokens in {core.kv.num_blocks:,} blocks of {config.block_size}: "
        f"{tokens // core.max_model_len:,} requests of the full context"
        f"{', int8 with scales' if config.kv_cache_dtype == 'int8' else ''}",
        f"  batching  up to {config.max_num_seqs} sequences and {config.max_num_batched_tokens} "
        f"tokens a step; prefix caching {'on' if core.kv.enable_caching else 'off'}; "
        f"async scheduling {'on' if config.async_scheduling else 'off'}",
        f"  kernels   {executor.kernel_summary()}",
        f"  API       {url}/v1",
        f"  page      {url}/",
        f"  metrics   {url}/metrics",
    ]
    if core.pooling is not None and core.pooling.is_classifier:  # a cross-encoder
        lines.insert(3, f"  runner    pooling: a sequence classifier of "
                        f"{len(core.pooling.labels)} label(s), last token through its head "
                        "(/v1/score, /v1/rerank, /v1/classify)")
    elif core.pooling is not None:  # --runner pooling (docs/embeddings.md)
        how = {"last": "last-token", "mean": "mean", "cls": "CLS"}[core.pooling.method]
        lines.insert(3, f"  runner    pooling: {how} pooling, "
                        f"{'normalised ' if core.pooling.normalize else ''}embeddings of "
                        f"{arch.hidden_size} values (/v1/embeddings, /v1/score, /v1/rerank)")
    return "\n".join(lines)
