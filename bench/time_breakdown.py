"""Where a tidal server's time goes: queue, prefill and decode, per workload.

Runs a few streamed ``/v1/completions`` workloads with the load generator, one after the other,
reads the server's ``/metrics`` before and after each, and prints, from the engine's phase
histograms, the mean time a request spent waiting to be scheduled, reaching its first token and
decoding the rest, with their shares, the preemptions per request and the time to tokenize a
prompt. A lifecycle view of the same runs ``bench/serving_comparison.py`` times from the
client: a high TTFT from queueing looks nothing like one from long prefills.

    python -m bench.time_breakdown                       # starts a server on the bench model
    python -m bench.time_breakdown --url http://127.0.0.1:8000
    python -m bench.time_breakdown --quick --model default
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.load_generator import RequestClass, Workload, run_classes
from bench.prompt_text import text_prompts
from bench.server_metrics import phases_markdown
from tidal.app.launch import run_event_loop


@dataclass
class Mix:
    """A workload: short requests at a concurrency, and long prompts one at a time beside
    them."""

    name: str
    concurrency: int
    input_len: int
    output_len: int
    num_requests: int
    long_len: int = 0
    num_long: int = 0


FULL = [Mix("c1-in32", 1, 32, 64, 4), Mix("c16-in32", 16, 32, 64, 32),
        Mix("c16-in512", 16, 512, 64, 32),
        Mix("mixed", 8, 32, 64, 16, long_len=1500, num_long=2)]
QUICK = [Mix("c1-in16", 1, 16, 8, 2), Mix("c4-in16", 4, 16, 8, 4),
         Mix("mixed", 2, 16, 8, 2, long_len=300, num_long=1)]


def classes_of(mix: Mix, tokenizer: Any, seed: int) -> dict[str, RequestClass]:
    short = Workload(mix.input_len, mix.output_len, mix.num_requests,
                     concurrency=mix.concurrency, seed=seed)
    out = {"short": RequestClass(short, list(text_prompts(tokenizer, mix.num_requests,
                                                          mix.input_len, seed)))}
    if mix.num_long:
        long = Workload(mix.long_len, mix.output_len, mix.num_long, concurrency=1,
                        seed=seed + 1)
        out["long"] = RequestClass(long, list(text_prompts(tokenizer, mix.num_long,
                                                           mix.long_len, seed + 1)))
    return out


def breakdown(url: str, model: str, tokenizer: Any, mixes: list[Mix]
              ) -> list[tuple[str, dict[str, Any]]]:
    """``(workload, phase breakdown)`` of each mix, run one after the other on ``url``."""
    rows = []
    for index, mix in enumerate(mixes):
        report = run_event_loop(run_classes(url, model, classes_of(mix, tokenizer,
                                                                   1000 * (index + 1))))
        failed = sum(c["failed"] for c in report["classes"].values())
        if failed:
            raise RuntimeError(f"{mix.name}: {failed} requests failed: {report['classes']}")
        phases = (report.get("server") or {}).get("phases")
        if phases is None:
            raise RuntimeError(f"{url} reports no phase histograms in /metrics")
        rows.append((mix.name, phases))
    return rows


def main(argv: list[str] | None = None) -> list[tuple[str, dict[str, Any]]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=None, help="a running tidal server's root URL (default: "
                    "start one on --model)")
    ap.add_argument("--model", default=None, help="the model to serve, or 'default' for the "
                    "embedded one (default: the random benchmark Llama)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra argument for the server started (repeatable)")
    ap.add_argument("--quick", action="store_true", help="small workloads: a smoke run")
    ap.add_argument("--out", default=None, help="also write the breakdown here as JSON")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from bench.comparison_model import resolve_model
    from bench.processes import LaunchedServer

    mixes = QUICK if args.quick else FULL
    server = None
    if args.url is None:
        server = LaunchedServer(resolve_model(args.model), args.server_arg)
    try:
        if server is not None:
            server.wait_ready()
            url, model, path = server.url, server.model, server.model
        else:
            url = args.url.rstrip("/")
            with urllib.request.urlopen(url + "/v1/models", timeout=30) as resp:
                entry = json.load(resp)["data"][0]
            model, path = entry["id"], entry.get("root") or entry["id"]
        rows = breakdown(url, model, AutoTokenizer.from_pretrained(path), mixes)
    finally:
        if server is not None:
            server.stop()
    print(phases_markdown(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(dict(rows), indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
