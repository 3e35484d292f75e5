"""The command line: ``python -m tidal serve`` / ``tidal serve`` and its flags.

``build_parser`` declares every flag (README's flags table lists them); ``main`` parses the
command line and hands ``serve`` to ``app/launch.py``, which loads the model and serves.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Sequence
from dataclasses import fields
from types import SimpleNamespace

from tidal.app.banner import package_version
from tidal.app.reasoning import FORMATS
from tidal.app.tool_parsers import PARSERS

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2,
          "mib": 1 << 20, "g": 1000**3, "gb": 1000**3, "gib": 1 << 30}



def _offload_bytes(text: str) -> int:
    return 0 if text.strip() == "0" else parse_bytes(text)


def parse_bytes(text: str) -> int:
    """``"1073741824"``, ``"512MiB"``, ``"2GiB"``, ``"1.5GB"`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 2GiB, 512MiB)")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def _int_from(least: int, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}: {text!r}")
    return value


def _positive_int(text: str) -> int:
    return _int_from(1, text)


def _non_negative_int(text: str) -> int:
    return _int_from(0, text)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds: {text!r}")
    return value


class _DefaultsFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to help texts that do not already say their default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" not in text and action.default not in (None, argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    from tidal.app.server_state import DEFAULT_REQUEST_BODY_TIMEOUT
    from tidal.core.config import (
        DEFAULT_MODEL_NAME,
        EXECUTOR_BACKENDS,
        KV_CACHE_DTYPES,
        QUANTIZATION_GROUP_SIZES,
        QUANTIZATIONS,
        RUNNERS,
        SCHEDULING_POLICIES,
        EngineConfig,
    )

    defaults = SimpleNamespace(**{f.name: f.default for f in fields(EngineConfig)})
    parser = argparse.ArgumentParser(
        prog="tidal", description="tidal: a streaming LLM inference server with an "
        "OpenAI-compatible API.")
    parser.add_argument("--version", action="version", version=f"tidal {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve", help="serve a model over HTTP (OpenAI API, SSE) and a websocket",
        description="Serve a model: POST /v1/chat/completions, POST /v1/completions, "
        "GET /v1/models, GET /health, GET /metrics, WS /v1/chat/ws and a chat page at /.",
        formatter_class=_DefaultsFormatter)

    model = serve.add_argument_group("model")
    model.add_argument("--model", default=None,
                       help="Hugging Face model directory or GGUF file to serve (default: the "
                       f"embedded model, served as '{DEFAULT_MODEL_NAME}')")
    model.add_argument("--tokenizer", default=None, metavar="DIR",
                       help="tokenizer directory to use instead of the model's (a GGUF's is "
                       "built from its metadata)")
    model.add_argument("--served-model-name", default=None,
                       help="model id that /v1/models lists and requests must name "
                       "(default: the --model value as given)")
    model.add_argument("--dtype", default=defaults.dtype,
                       choices=["auto", "float32", "bfloat16", "float16"],
                       help="weight and activation dtype; 'auto' is float32 on CPU and "
                       "bfloat16 on GPU")
    model.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                       help="quantize the decoder layers' weights at load: 'int8' (one scale "
                       "per output channel) or 'int4' (groups of --quantization-group-size); "
                       "the output head becomes int8 per row, an untied embedding keeps --dtype")
    model.add_argument("--quantization-group-size", type=int, default=32,
                       choices=QUANTIZATION_GROUP_SIZES, help="inputs sharing an int4 scale")
    model.add_argument("--max-model-len", type=_positive_int, default=None,
                       help="context length in tokens (default: the model's "
                       "max_position_embeddings)")
    model.add_argument("--runner", default=defaults.runner, choices=RUNNERS,
                       help="'generate' serves text; 'pooling' serves embeddings, scores and "
                       "reranking (/v1/embeddings, /v1/score, /v1/rerank): each request one "
                       "prefill, pooled as the model's sentence-transformers files say "
                       "(docs/embeddings.md)")

    server = serve.add_argument_group("server")
    server.add_argument("--host", default=DEFAULT_HOST, help="address to bind")
    server.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to bind")

    engine = serve.add_argument_group("engine and scheduler")
    engine.add_argument("--max-num-seqs", type=_positive_int, default=defaults.max_num_seqs,
                        help="most sequences in one batch")
    engine.add_argument("--scheduling-policy", default=defaults.scheduling_policy,
                        choices=SCHEDULING_POLICIES,
                        help="'fcfs': first come, first served, clients in turn; 'priority': "
                        "each request's priority field, the lowest first, preempting running "
                        "requests it outranks")
    engine.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                        help="most tokens (prefill chunks + decodes) in one step (default: 192 "
                        "on CPU, 2048 on GPU)")
    engine.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                        help="bytes of KV cache, e.g. 2GiB (default: 1 GiB on CPU; on GPU "
                        "what --gpu-memory-utilization leaves)")
    engine.add_argument("--kv-offload-size", type=_offload_bytes, default=0,
                        help="bytes of host memory for a second tier of KV blocks, e.g. 8GiB: "
                        "prefix blocks the cache evicts are kept there and copied back on a "
                        "hit instead of computed again (default: none)")
    engine.add_argument("--kv-offload-path", default=None, metavar="DIR",
                        help="a directory where the host tier spills the blocks it evicts; "
                        "a server started again with the same model and path finds those "
                        "prefixes (needs --kv-offload-size; default: no disk)")
    engine.add_argument("--kv-offload-disk-size", type=parse_bytes, default=None,
                        help="bytes of disk for --kv-offload-path, e.g. 100GiB (default: 16GiB)")
    engine.add_argument("--kv-cache-dtype", default=defaults.kv_cache_dtype,
                        choices=KV_CACHE_DTYPES,
                        help="'auto' keeps the KV cache in the model's dtype; 'int8' stores it "
                        "in 8 bits with a float32 scale per token and KV head: about twice the "
                        "tokens in the same memory (four times a float32 model's), and half "
                        "the bytes each decode step reads")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=defaults.enable_prefix_caching,
                        help="reuse the KV cache of shared prompt prefixes")
    engine.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=None, help="schedule step N+1 while step N runs on the device "
                        "(default: on GPU only)")
    engine.add_argument("--speculative-config", default=None, metavar="JSON",
                        help="speculative decoding, vLLM's JSON shape: '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, "
                        "\"prompt_lookup_max\": 5}' proposes up to 4 tokens a step from the "
                        "prompt and output so far, verified by the model in the same step; "
                        "'{\"method\": \"suffix\"}' also from recent requests' outputs; "
                        "'{\"method\": \"draft_model\", \"model\": DIR}' from a small draft "
                        "model (the embedded model ships one); with async scheduling, ngram "
                        "and suffix speculate only in the steps where it is measured to pay "
                        "(docs/speculative-decoding.md)")
    engine.add_argument("--request-timeout", type=_positive_seconds, default=None,
                        metavar="SECONDS", help="abort a request still waiting or running this "
                        "long after it arrived (finish_reason 'abort'); a request's own "
                        "'timeout' field may ask for less (default: no limit)")

    device = serve.add_argument_group("device (CPU and GPU)")
    device.add_argument("--device", default=defaults.device, help="'cpu', 'cuda' or 'cuda:N'")
    device.add_argument("--attention-backend", default=defaults.attention_backend,
                        choices=["auto", "cpu", "torch", "triton"],
                        help="'auto' is cpu (C++ decode kernels) on CPU and triton on GPU")
    device.add_argument("--cpu-kernels", default=None, choices=["auto", "force", "off"],
                        help="CPU: 'auto' times tidal's kernels, oneDNN, MKL and torch for each "
                        "op on this host and keeps the fastest (cached per machine); 'force' "
                        "uses tidal's kernels; 'off' torch's own paths (default: "
                        "$TIDAL_CPU_KERNELS, else auto)")
    device.add_argument("--gpu-memory-utilization", type=float,
                        default=defaults.gpu_memory_utilization,
                        help="GPU: fraction of GPU memory tidal may use when --kv-cache-memory "
                        "is not given")
    device.add_argument("--enforce-eager", action="store_true",
                        help="GPU: run decode steps eagerly, without CUDA graphs")

    dist = serve.add_argument_group("several devices and machines")
    dist.add_argument("--tensor-parallel-size", type=_positive_int,
                      default=defaults.tensor_parallel_size,
                      help="split the model over N worker processes (one per GPU, or CPU "
                      "processes sharing the cores), all-reducing between them")
    dist.add_argument("--pipeline-parallel-size", type=_positive_int,
                      default=defaults.pipeline_parallel_size,
                      help="split the model's layers into N stages in turn, each a "
                      "tensor-parallel group, passing activations between them "
                      "(docs/distributed.md)")
    dist.add_argument("--distributed-executor-backend", choices=EXECUTOR_BACKENDS, default=None,
                      help="mp: the model in worker processes, one per rank (also for one "
                      "rank); uni: in the server's process; ray: in Ray actors, one per rank, "
                      "on the Ray cluster found ($RAY_ADDRESS, a 'ray start --head' here) or "
                      "a local one (pip install 'tidal[ray]'; docs/distributed.md) "
                      "(default: mp for several ranks)")
    dist.add_argument("--nnodes", type=_positive_int, default=defaults.nnodes,
                      help="machines the ranks (tensor x pipeline) span")
    dist.add_argument("--node-rank", type=int, default=defaults.node_rank,
                      help="this machine's place among --nnodes; only node 0 serves HTTP, the "
                      "others run their workers")
    dist.add_argument("--distributed-init-method", default=None, metavar="URL",
                      help="where the ranks meet, tcp://HEAD_IP:PORT (default: a free port "
                      "on this machine; needed with --nnodes > 1)")

    api = serve.add_argument_group("API and security")
    api.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer <key>' on every route but /health "
                     "and the chat page's HTML (the websocket also takes it as a subprotocol)")
    api.add_argument("--metrics-without-key", action="store_true",
                     help="serve /metrics without --api-key's key, to a scraper")
    api.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                     help="origins whose web pages may call the API (CORS), e.g. "
                     "http://localhost:3000, or '*' for any (default: none)")
    api.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                     help="Host header names the server answers to (others get 400: DNS "
                     "rebinding), e.g. tidal.internal, .example.com for it and its "
                     "subdomains, or '*' (default: on a loopback --host the loopback names, "
                     "else any)")
    api.add_argument("--max-request-bytes", type=parse_bytes, default="4MiB",
                     help="largest request body accepted (larger ones get 413)")
    api.add_argument("--request-body-timeout", type=_positive_seconds,
                     default=DEFAULT_REQUEST_BODY_TIMEOUT, metavar="SECONDS",
                     help="time a request body may take to arrive after its headers (a "
                     "slower one gets 408 and its connection closed)")

    limits = serve.add_argument_group(
        "limits and admission", "per-request caps (400 naming the field), grammar bounds and "
        "admission control (429 with Retry-After); docs/robustness.md")
    limits.add_argument("--max-prompts-per-request", type=_positive_int, default=256,
                        help="most prompts in one /v1/completions request")
    limits.add_argument("--max-request-tokens", type=_positive_int, default=1 << 20,
                        help="most tokens one request may put through the engine: its prompt "
                        "tokens plus n x max_tokens per prompt (an unset max_tokens counts "
                        "the room left in the context)")
    limits.add_argument("--max-tools", type=_positive_int, default=128,
                        help="most tools in one chat request")
    limits.add_argument("--max-waiting-seqs", type=_non_negative_int, default=512,
                        help="sequences that may wait beyond a full batch (--max-num-seqs); a "
                        "request that would pass it gets 429 with Retry-After")
    limits.add_argument("--max-waiting-seqs-per-client", type=_non_negative_int, default=None,
                        help="the same bound for one client's sequences (default: half of "
                        "--max-waiting-seqs)")
    limits.add_argument("--fair-share-by", default="address",
                        choices=["address", "api-key", "user", "none"],
                        help="who a client is, for its share of the queue and the "
                        "scheduler's round-robin: its peer address, the API key it presents, "
                        "the body's 'user' field, or all alike")
    limits.add_argument("--grammar-compile-timeout", type=_positive_seconds,
                        default=defaults.grammar_compile_timeout, metavar="SECONDS",
                        help="a grammar (response_format, structured_outputs, tools) still "
                        "compiling this long fails with 400")
    limits.add_argument("--grammar-compile-workers", type=_positive_int,
                        default=defaults.grammar_compile_workers,
                        help="grammars compiled at once")
    limits.add_argument("--grammar-cache-bytes", type=parse_bytes,
                        default=defaults.grammar_cache_bytes,
                        help="memory the compiled-grammar cache may hold, e.g. 256MiB")

    chat = serve.add_argument_group("chat and tools")
    chat.add_argument("--chat-template", default=None, metavar="FILE",
                      help="a Jinja2 chat template to use instead of the model's")
    chat.add_argument("--tool-call-parser", default="auto",
                      choices=["auto", *PARSERS],
                      help="the format of the model's tool calls (default: the one its chat "
                      "template uses, else hermes)")
    chat.add_argument("--reasoning-parser", default="auto",
                      choices=["auto", "none", *FORMATS],
                      help="where the model's thinking ends: <think>...</think> (gpt_oss: "
                      "Harmony's analysis channel) goes to reasoning_content (default: by the "
                      "chat template's markers; none: off)")

    logs = serve.add_argument_group("logging")
    logs.add_argument("--log-level", default="info",
                      choices=["debug", "info", "warning", "error"], help="logging level")
    logs.add_argument("--enable-request-tracing", action="store_true",
                      help="log one JSON line per finished request (logger tidal.trace): its "
                      "phases, token counts, cache hits, steps and preemptions")
    logs.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                      help="send each request's phases as OpenTelemetry spans to this OTLP/HTTP "
                      "collector, e.g. http://127.0.0.1:4318/v1/traces (needs "
                      "opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http)")
    plans = commands.add_parser(
        "plans", help="show, re-time or clear this machine's CPU plans",
        description="The CPU plans: which kernel runs each op at each batch size, timed on "
        "this host and kept in ~/.cache/tidal (TIDAL_CACHE_DIR).")
    plans.add_argument("action", nargs="?", choices=["show", "retime", "clear"],
                       default="show", help="show them (the default); mark them to be timed "
                       "again once a server idles; or delete them, so the next start times "
                       "them")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "warning").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        from tidal.app.launch import serve

        sys.exit(serve(args))
    if args.command == "plans":
        from tidal.core.executor import cpu_plans

        print(cpu_plans(args.action))


if __name__ == "__main__":
    main()
