"""Structured outputs under load: what holding every reply to a JSON schema costs a server.

Starts one tidal server (``python -m tidal serve``, with the flags the serving comparison gives
tidal) on the benchmark Llama (``--shape llama-28m``; ``--model DIR`` for another) and sends
it streamed, greedy ``/v1/completions`` with text prompts of ``--input-len`` tokens, at
``--concurrency`` requests in flight, ``--num-requests`` per round, in two arms that take
turns round by round (free, constrained, free, constrained, ...):

- ``free``: ``ignore_eos``, so every reply runs to ``--max-tokens``;
- ``constrained``: every request carries ``response_format`` ``json_schema`` with the shared
  mid-sized schema (``bench/structured_workload.py``'s ``MID_SCHEMA``); a reply ends where its
  JSON closes, or at ``--max-tokens``.

Replies differ in length between the arms, so the comparison is of output tokens actually
streamed per second, TTFT and ITL; both arms count output tokens alike, from the usage the
stream ends with. Every constrained reply is parsed and validated with ``jsonschema``: one
cut by ``--max-tokens`` is counted apart from one that finished and still does not validate
(the latter would be a server bug). Each arm's median round by output tok/s is reported, with
every round's figure and the ratios constrained / free, checked against ``TARGETS``.

Grammar compile times, before the rounds, one request at a time (``max_tokens`` 1): TTFT of a
free request, of the first constrained request (xgrammar's import and the vocabulary's
reading come with it), of a schema no cache holds yet (``MID_SCHEMA`` with a property renamed)
and of the same schema again; the difference from the free TTFT is the compile. After the
server stops, the same in this process through ``GrammarCompiler`` itself.

    python -m bench.structured
    python -m bench.structured --num-requests 8 --concurrency 2 --rounds 1 --name quick

Writes ``bench/results/structured[-NAME].json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import write_result
from bench.comparison_model import model_params_m, resolve_model
from bench.load_generator import (
    Workload,
    request_body,
    summarize,
)
from bench.model_shapes import ALL_SHAPES
from bench.processes import LaunchedServer
from bench.prompt_text import text_prompts
from bench.structured_report import ARMS, compile_summary, markdown, ratios, summarize_arms
from bench.structured_stream import Reply, send_all, validity
from bench.structured_workload import MID_SCHEMA
from tidal.app.launch import run_event_loop

PROBE_SEED, WARM_UP_SEED = 50_000, 70_000


def schema_variant(i: int) -> dict:
    """``MID_SCHEMA`` with its ``name`` property renamed ``name_<i>``: a grammar of the same
    size that no cache holds yet."""
    props = {(f"name_{i}" if k == "name" else k): v for k, v in MID_SCHEMA["properties"].items()}
    required = [f"name_{i}" if k == "name" else k for k in MID_SCHEMA["required"]]
    return {**MID_SCHEMA, "properties": props, "required": required}


def constraint(schema: dict) -> dict[str, Any]:
    return {"ignore_eos": False, "response_format": {
        "type": "json_schema", "json_schema": {"name": "record", "schema": schema}}}


def bodies(arm: str, model: str, prompts: list[str], max_tokens: int) -> list[dict[str, Any]]:
    """Streamed greedy bodies with usage at the end (``request_body``'s), the constrained arm's
    held to ``MID_SCHEMA``."""
    extra = constraint(MID_SCHEMA) if arm == "constrained" else {}
    return [request_body("tidal", model, p, max_tokens) | extra for p in prompts]


# -- streaming ------------------------------------------------------------------------------
def host_cpu_s() -> float | None:
    """CPU seconds the whole host has spent busy since boot (Linux), else None."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split()[1:9]]
    except (OSError, ValueError):
        return None
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def run_round(server: LaunchedServer, arm: str, prompts: list[str], args: argparse.Namespace
              ) -> dict[str, Any]:
    payloads = bodies(arm, server.model, prompts, args.max_tokens)
    host, client = host_cpu_s(), time.process_time()
    replies, duration, side = run_event_loop(send_all(server.url, payloads, args.concurrency))
    work = Workload(args.input_len, args.max_tokens, len(prompts), args.concurrency)
    report: dict[str, Any] = {"classes": {"all": summarize(replies, duration, work)},
                              "finish_reasons": _finish_reasons(replies),
                              "load_average_after": round(os.getloadavg()[0], 2),
                              "client_cpu_s": time.process_time() - client}
    if side:
        report["server"] = side
    if host is not None and side:  # what neither the server nor this client used
        report["other_cpu_s"] = (host_cpu_s() - host - side["process_cpu_s"]
                                 - report["client_cpu_s"])
    if arm == "constrained":
        report["validity"] = validity(replies, MID_SCHEMA)
    return report


def _finish_reasons(replies: list[Reply]) -> dict[str, int]:
    reasons: dict[str, int] = {}
    for r in replies:
        reasons[str(r.finish_reason)] = reasons.get(str(r.finish_reason), 0) + 1
    return reasons


def run_arms(server: LaunchedServer, prompts: dict[str, list[list[str]]],
             args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """``--rounds`` rounds of each arm, the arms taking turns."""
    rounds: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        for arm in ARMS:
            t0 = time.perf_counter()
            rounds[arm].append(run_round(server, arm, prompts[arm][r], args))
            _progress(arm, r, rounds[arm][-1], time.perf_counter() - t0)
    return rounds


def _progress(arm: str, r: int, report: dict[str, Any], seconds: float) -> None:
    rep = report["classes"]["all"]
    ttft = (rep.get("ttft") or {}).get("median_ms") or 0
    checked = report.get("validity")
    valid = "" if checked is None else f", {checked['valid']} valid"
    other = report.get("other_cpu_s")
    others = "" if other is None else f", other processes {other:.0f} CPU s"
    print(f"[{arm}] round {r + 1} ({seconds:.0f} s): "
          f"{rep['output_token_throughput_per_s']:.1f} tok/s, TTFT p50 {ttft:.0f} ms, "
          f"{rep['failed']} failed{valid}{others}", flush=True)


def warm_up(server: LaunchedServer, arm: str, tokenizer: Any, args: argparse.Namespace,
            seed: int) -> None:
    """One unmeasured wave of the arm: as many requests as the concurrency."""
    prompts = text_prompts(tokenizer, args.concurrency, args.input_len, seed)
    replies, _, _ = run_event_loop(send_all(
        server.url, bodies(arm, server.model, prompts, args.max_tokens), args.concurrency))
    failed = [r.error for r in replies if not r.ok]
    if failed:
        raise RuntimeError(f"{arm} warm-up failed: {failed[:3]}")


# -- compile times --------------------------------------------------------------------------
def probe_ttft_ms(server: LaunchedServer, prompt: str, schema: dict | None) -> float:
    """TTFT of one request alone, ``max_tokens`` 1, constrained to ``schema`` if given."""
    body = request_body("tidal", server.model, prompt, 1)
    if schema is not None:
        body |= constraint(schema)
    replies, _, _ = run_event_loop(send_all(server.url, [body], 1))
    if not replies[0].ok:
        raise RuntimeError(f"compile probe failed: {replies[0].error}")
    return replies[0].ttft * 1e3


def server_compile_times(server: LaunchedServer, tokenizer: Any, args: argparse.Namespace
                         ) -> dict[str, Any]:
    """TTFTs of free requests, of the first constrained one, and of ``--compile-probes``
    new schemas each sent twice (cold, then cached), every request with a prompt of its own."""
    prompts = iter(text_prompts(tokenizer, 3 * args.compile_probes + 2, args.input_len,
                                PROBE_SEED))
    free = [probe_ttft_ms(server, next(prompts), None)]
    first = probe_ttft_ms(server, next(prompts), schema_variant(0))
    cold, cached = [], []
    for i in range(1, args.compile_probes + 1):
        free.append(probe_ttft_ms(server, next(prompts), None))
        cold.append(probe_ttft_ms(server, next(prompts), schema_variant(i)))
        cached.append(probe_ttft_ms(server, next(prompts), schema_variant(i)))
    return {"free_ttft_ms": free, "first_ttft_ms": first, "cold_ttft_ms": cold,
            "cached_ttft_ms": cached}


def timed_ms(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def in_process_compile_times(model: str, probes: int) -> dict[str, Any]:
    """``GrammarCompiler.submit(...).result()`` as the engine builds it for ``model``: the
    first (xgrammar's import, the vocabulary and a compile), ``probes`` new schemas, the
    same again from the cache."""
    from transformers import AutoConfig, AutoTokenizer

    from tidal.core.structured_output.compiler import GrammarCompiler
    from tidal.core.structured_output.params import StructuredOutputsParams

    tokenizer = AutoTokenizer.from_pretrained(model)
    vocab = AutoConfig.from_pretrained(model).vocab_size
    compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id])

    def compile_ms(i: int) -> float:
        return timed_ms(compiler.submit(StructuredOutputsParams(json=schema_variant(i))).result)

    try:
        first = compile_ms(0)
        cold = [compile_ms(i) for i in range(1, probes + 1)]
        cached = [compile_ms(i) for i in range(1, probes + 1)]
    finally:
        compiler.shutdown()
    return {"vocab_size": vocab, "first_ms": first, "cold_ms": cold, "cached_ms": cached}


# -- the report -----------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model directory (instead of --shape)")
    ap.add_argument("--shape", choices=list(ALL_SHAPES), default=None,
                    help="a random float32 model of this shape (default: llama-28m, the "
                    "benchmark Llama, unless --model is given)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra argument for tidal (repeatable)")
    ap.add_argument("--num-requests", type=int, default=96, help="requests per round")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each arm")
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--compile-probes", type=int, default=8,
                    help="new schemas timed cold and cached")
    ap.add_argument("--name", default=None,
                    help="results file suffix: bench/results/structured-NAME.{json,md}")
    args = ap.parse_args(argv)
    if args.model and args.shape:
        ap.error("--model and --shape are alternatives: give one")
    if min(args.num_requests, args.concurrency, args.rounds, args.compile_probes) < 1:
        ap.error("--num-requests, --concurrency, --rounds and --compile-probes must be >= 1")
    if not args.model:
        args.shape = args.shape or "llama-28m"
    return args


def round_prompts(tokenizer: Any, args: argparse.Namespace) -> dict[str, list[list[str]]]:
    """Prompts of their own for every round of every arm (repeats would hit the prefix
    cache)."""
    return {arm: [text_prompts(tokenizer, args.num_requests, args.input_len,
                               1000 * (a + 1) + 10 * r) for r in range(args.rounds)]
            for a, arm in enumerate(ARMS)}


def serve(model: str, tokenizer: Any, args: argparse.Namespace
          ) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """Start tidal, warm it up free, time the compiles, warm it up constrained, run the
    rounds; the server's compile probes and the rounds."""
    prompts = round_prompts(tokenizer, args)
    server = LaunchedServer(model, args.server_arg)
    try:
        server.wait_ready()
        warm_up(server, "free", tokenizer, args, WARM_UP_SEED)
        probes = server_compile_times(server, tokenizer, args)
        warm_up(server, "constrained", tokenizer, args, WARM_UP_SEED + 1)
        return probes, run_arms(server, prompts, args)
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    model = resolve_model(args.model, args.shape)
    tokenizer = AutoTokenizer.from_pretrained(model)
    load_start = os.getloadavg()[0]
    probes, rounds = serve(model, tokenizer, args)
    local = in_process_compile_times(model, args.compile_probes)
    arms = summarize_arms(rounds)
    result = {
        "setup": {"model": model, "model_params_m": model_params_m(model), "shape": args.shape,
                  "tidal_args": args.server_arg, "concurrency": args.concurrency,
                  "num_requests": args.num_requests, "rounds": args.rounds,
                  "input_len": args.input_len, "max_tokens": args.max_tokens,
                  "compile_probes": args.compile_probes, "schema": MID_SCHEMA,
                  "load_average": [round(load_start, 2), round(os.getloadavg()[0], 2)],
                  "argv": sys.argv[1:] if argv is None else argv},
        "arms": arms,
        "ratios": ratios(arms["free"]["median_round"]["classes"]["all"],
                         arms["constrained"]["median_round"]["classes"]["all"]),
        "compile": compile_summary(probes, local) | {"server_probes": probes,
                                                     "in_process": local},
    }
    path = write_result("structured" + (f"-{args.name}" if args.name else ""), result)
    stored = json.loads(path.read_text())
    md = path.with_suffix(".md")
    md.write_text(markdown(stored) + "\n")
    print(markdown(stored))
    print(f"wrote {path} and {md}")
    return path


if __name__ == "__main__":
    main()
