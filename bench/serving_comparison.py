"""Serving comparison: tidal against its peers on the same model and workloads.

The peers (``--peer``, ``bench/peers.py``): ``transformers serve`` (the default), vLLM's CPU
build (``vllm``) and llama.cpp's ``llama-server`` (``llamacpp``), one or several of them
(``--peer vllm llamacpp``; ``all``: every one that can be had here; ``none``: tidal alone). A
peer that is not installed, or does not come up, is skipped with the reason.

Starts tidal and the peers on loopback with the same model directory, sends each the same
streamed ``/v1/completions`` workloads with the load generator, one server at a time, workload
by workload (``--no-interleave``: every workload on one server, then on the next), and writes
``bench/results/<name>.json`` and ``.md`` (both naming the host: CPU, SIMD flags, cores, GPU,
torch and commit) with the ratios ours / peer, for each peer, of output tokens/s, requests/s
and p50/p99 TTFT, inter-token latency and end-to-end latency, then the plots.

Workloads (greedy, EOS ignored, prompts are text of exact token lengths):
- ``c{N}-in{L}``: N requests in flight, L-token prompts, ``--output-len`` tokens out;
- ``shared-prefix``: every prompt starts with the same system prompt (prefix caching);
- ``mixed``: short chats at ``--mixed-concurrency`` while long prompts arrive one at a time;
  the short ones' p99 ITL shows how well long prefills are chunked around them.

With ``--repeats N`` every workload runs N rounds, the servers alternating, and each server's
median round (by output tok/s) is the one reported, beside every round's output tok/s: a
single run of a few seconds moves with the host's load. Before a workload's first round each
server gets one unmeasured wave of it: as many requests as its concurrency, of its prompt and
output lengths (``--no-scenario-warmup`` skips it). Without it, the peer's first round at a new
concurrency was often its slowest; a burst of short outputs did not cure that, a whole wave did.

    python -m bench.serving_comparison --quick          # a smoke run, about a minute
    python -m bench.serving_comparison                  # the full run, 15-30 min on 2 cores
    python -m bench.serving_comparison --model default --peer none
    python -m bench.serving_comparison --shape llama-28m --peer vllm llamacpp \
        --concurrency 1 32 --num-requests 8 96 --input-lens 128 --output-len 128 \
        --shared-prefix-len 0 --num-long 0     # 128 in / 128 out at c1 and c32
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, write_result
from bench.comparison_model import (
    add_model_args,
    check_model_args,
    model_params_m,
    resolve_args_model,
)
from bench.load_generator import RequestClass, Workload, run_classes
from bench.peers import PEERS, Peer, add_peer_args, find_peers
from bench.processes import LaunchedServer, wait_settled
from bench.prompt_text import text_prompts
from bench.serving_report import markdown
from tidal.app.launch import run_event_loop

# Scenario seeds are 1,000 apart (``plan``); a round's prompts take seed + 10 x round (a scenario
# uses seed, seed + 1 and seed + 2), so every round of every scenario has prompts of its own.
ROUND_SEED_STEP = 10
MAX_REPEATS = 99
# A scenario's warm-up wave takes seed + this, past every round's seeds.
WARM_UP_SEED_OFFSET = ROUND_SEED_STEP * MAX_REPEATS + 5


@dataclass
class Scenario:
    name: str
    concurrency: int
    input_len: int
    output_len: int
    num_requests: int
    shared_prefix_len: int = 0  # > 0: prompts share a system prompt of this many tokens
    long_len: int = 0  # > 0: long prompts of this many tokens run beside the short ones
    num_long: int = 0
    long_output_len: int = 0
    seed: int = 0


# -- the plan -------------------------------------------------------------------------------
def plan(args: argparse.Namespace) -> list[Scenario]:
    scenarios = []
    for input_len in args.input_lens:
        for index, conc in enumerate(args.concurrency):
            requests = (args.num_requests[index % len(args.num_requests)] if args.num_requests
                        else _num_requests(args, conc))
            scenarios.append(Scenario(f"c{conc}-in{input_len}", conc, input_len,
                                      args.output_len, requests))
    if args.shared_prefix_len:
        conc = args.shared_concurrency
        scenarios.append(Scenario("shared-prefix", conc, args.shared_input_len,
                                  args.output_len, _num_requests(args, conc),
                                  shared_prefix_len=args.shared_prefix_len))
    if args.num_long:
        conc = args.mixed_concurrency
        scenarios.append(Scenario("mixed", conc, args.mixed_input_len, args.output_len,
                                  _num_requests(args, conc), long_len=args.long_len,
                                  num_long=args.num_long, long_output_len=args.long_output_len))
    for index, scenario in enumerate(scenarios):
        scenario.seed = 1000 * (index + 1)  # distinct prompts: no accidental cache hits
    return scenarios


def _num_requests(args: argparse.Namespace, concurrency: int) -> int:
    return max(args.min_requests, args.requests_per_concurrency * concurrency)


def plan_needs(scenarios: list[Scenario]) -> dict[str, int]:
    """The most requests in flight and the longest sequence (prompt and output) of the plan:
    what a peer that sizes its slots up front (llama-server) must hold."""
    return {"concurrency": max(s.concurrency + (1 if s.num_long else 0) for s in scenarios),
            "sequence_tokens": max(max(s.input_len + s.output_len,
                                       s.long_len + s.long_output_len) for s in scenarios)}


def rounds_of(scenario: Scenario, tokenizer: Any, repeats: int
              ) -> list[dict[str, RequestClass]]:
    """The request classes of each round, every round with prompts of its own: repeated
    prompts would hit tidal's prefix cache from the second round on."""
    return [request_classes(replace(scenario, seed=scenario.seed + ROUND_SEED_STEP * r),
                            tokenizer) for r in range(repeats)]


def request_classes(scenario: Scenario, tokenizer: Any) -> dict[str, RequestClass]:
    s = scenario
    prefix = ""
    if s.shared_prefix_len:
        prefix = text_prompts(tokenizer, 1, s.shared_prefix_len, s.seed + 1)[0] + "\n"
    short = Workload(s.input_len, s.output_len, s.num_requests, concurrency=s.concurrency,
                     seed=s.seed)
    prompts = text_prompts(tokenizer, s.num_requests, s.input_len, s.seed, prefix)
    if not s.long_len:
        return {"all": RequestClass(short, list(prompts))}
    long = Workload(s.long_len, s.long_output_len, s.num_long, concurrency=1, seed=s.seed + 2)
    long_prompts = text_prompts(tokenizer, s.num_long, s.long_len, s.seed + 2)
    return {"short": RequestClass(short, list(prompts)),
            "long": RequestClass(long, list(long_prompts))}


# -- running --------------------------------------------------------------------------------
def warm_up(server: LaunchedServer, flavor: str, tokenizer: Any, requests: int,
            input_len: int = 16, output_len: int = 8, seed: int = 7) -> None:
    """``requests`` requests at once, unmeasured: the peer builds its batching manager on the
    first one, and both servers' first steps at a new batch size pay one-off costs."""
    prompts = text_prompts(tokenizer, requests, input_len, seed=seed)
    work = Workload(input_len, output_len, requests, concurrency=requests)
    report = run_event_loop(run_classes(server.url, server.model,
                                        {"all": RequestClass(work, list(prompts))}, flavor))
    failed = report["classes"]["all"]["failed"]
    if failed:
        raise RuntimeError(f"{flavor}: warm-up failed: {report['classes']['all']['errors']}")


def run_servers(starters: dict[str, Callable[[], LaunchedServer]], args: argparse.Namespace,
                prepared: list[tuple[Scenario, list[dict[str, RequestClass]]]],
                tokenizer: Any,
                reports: dict[str, dict[str, dict]], runs: dict[str, dict]) -> None:
    """Start the servers of ``starters`` together, then run every scenario on each of them in
    turn (``--repeats`` rounds of it), so that a change in the machine's load hits them alike.
    An idle server costs no CPU. A peer that does not come up or fails a warm-up is stopped
    and left out (``runs[kind]["skipped"]`` says why); tidal failing ends the run."""
    servers: dict[str, LaunchedServer] = {}

    def attempt(kind: str, step: Callable[[], object]) -> bool:
        try:
            step()
            return True
        except (OSError, RuntimeError, TimeoutError) as exc:
            if kind == "tidal":
                raise
            why = str(exc) if len(str(exc)) < 2000 else "..." + str(exc)[-2000:]
            runs[kind]["skipped"] = why
            print(f"[{kind}] skipped: {why}", flush=True)
            if kind in servers:
                servers.pop(kind).stop()
            return False

    try:
        for kind, start in starters.items():
            runs[kind] = {"load_average_start": os.getloadavg()[0]}
            attempt(kind, lambda kind=kind, start=start: servers.update({kind: start()}))
        for kind, server in list(servers.items()):
            started = time.perf_counter()
            if attempt(kind, server.wait_ready):
                runs[kind]["ready_after_s"] = time.perf_counter() - started
                if kind == "tidal":  # measured once its background upgrades are in
                    runs[kind]["settled_after_s"] = wait_settled(server.url)
                runs[kind]["memory_after_load"] = server.memory()
                attempt(kind, partial(warm_up, server, kind, tokenizer, args.warmup))
        for scenario, round_classes in prepared:
            if args.scenario_warmup:
                for kind, server in list(servers.items()):
                    attempt(kind, partial(warm_up, server, kind, tokenizer,
                                          scenario.concurrency, scenario.input_len,
                                          scenario.output_len,
                                          scenario.seed + WARM_UP_SEED_OFFSET))
            rounds: dict[str, list[dict]] = {kind: [] for kind in servers}
            for classes in round_classes:
                for kind, server in servers.items():
                    t0 = time.perf_counter()
                    report = run_event_loop(run_classes(server.url, server.model, classes,
                                                        kind, quantiles=True))
                    report["load_average_after"] = round(os.getloadavg()[0], 2)
                    rounds[kind].append(report)
                    _progress(kind, scenario, report, time.perf_counter() - t0)
            for kind, reps in rounds.items():
                reports.setdefault(kind, {})[scenario.name] = median_round(reps)
    finally:
        for kind, server in servers.items():
            runs[kind]["memory_at_end"] = server.memory()  # its peak too
            server.stop()
            runs[kind]["load_average_end"] = os.getloadavg()[0]


def total_output_tok_s(report: dict) -> float:
    return sum(c["output_token_throughput_per_s"] for c in report["classes"].values())


def median_round(rounds: list[dict]) -> dict:
    """The round with the median output tok/s (the lower middle of an even count), so that
    every figure reported for a workload comes from one coherent run. With several rounds,
    each one's output tok/s is kept beside it, in the order they ran."""
    totals = [total_output_tok_s(r) for r in rounds]
    order = sorted(range(len(rounds)), key=totals.__getitem__)
    chosen = rounds[order[(len(rounds) - 1) // 2]]
    if len(rounds) == 1:
        return chosen
    return chosen | {"round_output_tok_per_s": [round(t, 1) for t in totals]}


def _progress(kind: str, scenario: Scenario, report: dict, seconds: float) -> None:
    parts = []
    for name, rep in report["classes"].items():
        ttft = (rep.get("ttft") or {}).get("median_ms")
        itl = (rep.get("itl") or {}).get("p99_ms")
        parts.append(f"{name}: {rep['output_token_throughput_per_s']:.1f} tok/s, "
                     f"TTFT p50 {ttft or 0:.0f} ms, ITL p99 {itl or 0:.0f} ms, "
                     f"{rep['failed']} failed")
    print(f"[{kind}] {scenario.name} ({seconds:.0f} s): " + "; ".join(parts), flush=True)


# -- the command line -----------------------------------------------------------------------
QUICK = dict(concurrency=[1, 4], input_lens=[32], output_len=16, requests_per_concurrency=1,
             min_requests=2, shared_prefix_len=64, shared_input_len=96, shared_concurrency=4,
             num_long=1, long_len=1000, long_output_len=8, mixed_concurrency=2,
             mixed_input_len=32, warmup=2)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--peer", nargs="+", default=["transformers"], metavar="PEER",
                    help=f"one or several of {', '.join(PEERS)} (space or comma separated); "
                    "'all': every one that can be had here; 'none': tidal alone")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra argument for tidal (repeatable), e.g. --server-arg=--max-num-"
                    "seqs=32")
    ap.add_argument("--peer-arg", action="append", default=None,
                    help="extra argument for the one peer of --peer (repeatable); the same as "
                    "its own --transformers-arg, --vllm-arg or --llamacpp-arg")
    add_peer_args(ap)
    ap.add_argument("--order", choices=["peer-first", "tidal-first"], default="peer-first",
                    help="which server runs each workload first")
    ap.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=True,
                    help="keep every server up and alternate them workload by workload "
                    "(else: all workloads on one, then all on the next)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: small sizes (any size flag given still wins)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--input-lens", type=int, nargs="+", default=[32, 512])
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--requests-per-concurrency", type=int, default=2,
                    help="requests per run = this x concurrency (at least --min-requests)")
    ap.add_argument("--num-requests", type=int, nargs="+", default=None,
                    help="requests per run of each --concurrency value, in its order (one "
                    "value: for all); overrides --requests-per-concurrency there")
    ap.add_argument("--min-requests", type=int, default=4)
    ap.add_argument("--shared-prefix-len", type=int, default=448,
                    help="shared system prompt tokens (0: no shared-prefix workload)")
    ap.add_argument("--shared-input-len", type=int, default=512,
                    help="whole prompt tokens in the shared-prefix workload")
    ap.add_argument("--shared-concurrency", type=int, default=32)
    ap.add_argument("--num-long", type=int, default=3,
                    help="long prompts in the mixed workload (0: no mixed workload)")
    ap.add_argument("--long-len", type=int, default=2000)
    ap.add_argument("--long-output-len", type=int, default=32)
    ap.add_argument("--mixed-concurrency", type=int, default=8)
    ap.add_argument("--mixed-input-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds of every workload on each server, alternating; each server's "
                    "median round by output tok/s is reported, every round's tok/s kept")
    ap.add_argument("--warmup", type=int, default=4, help="warm-up requests per server")
    ap.add_argument("--scenario-warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="before each workload, one unmeasured wave of it on each server: as "
                    "many requests as its concurrency, of its prompt and output lengths")
    ap.add_argument("--name", default=None, help="results basename (default: "
                    "serving_comparison, or serving_comparison-quick with --quick)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--note", action="append", default=[],
                    help="a remark stored with the results (repeatable)")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.quick:
        given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:])}
        for key, value in QUICK.items():
            if "--" + key.replace("_", "-") not in given:
                setattr(args, key, value)
    if not 1 <= args.repeats <= MAX_REPEATS:
        ap.error(f"--repeats must be between 1 and {MAX_REPEATS}")
    if args.num_requests and len(args.num_requests) not in (1, len(args.concurrency)):
        ap.error(f"--num-requests takes one value or one per --concurrency value "
                 f"({len(args.concurrency)})")
    check_model_args(ap, args)
    try:
        args.peer = peer_list(args.peer)
    except ValueError as exc:
        ap.error(str(exc))
    if args.peer_arg is not None:
        if len(args.peer) != 1:
            ap.error("--peer-arg is for a single --peer; with several, use --transformers-arg, "
                     "--vllm-arg or --llamacpp-arg")
        own = f"{args.peer[0]}_arg"
        setattr(args, own, (getattr(args, own) or []) + args.peer_arg)
    args.name = args.name or ("serving_comparison-quick" if args.quick
                              else "serving_comparison")
    return args


def peer_list(values: list[str]) -> list[str]:
    """``--peer``'s values as peer names, in order, once each: commas split values, ``all``
    is every peer, ``none`` (alone) is no peer."""
    names = [n.strip() for v in values for n in v.split(",") if n.strip()]
    if "none" in names:
        if len(names) > 1:
            raise ValueError("--peer none takes no other peer")
        return []
    unknown = [n for n in names if n not in (*PEERS, "all")]
    if unknown or not names:
        raise ValueError(f"--peer: unknown {', '.join(unknown) or '(empty)'}; choose from "
                         f"{', '.join(PEERS)}, all, none")
    expanded = [p for n in names for p in (PEERS if n == "all" else (n,))]
    return list(dict.fromkeys(expanded))


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    model = resolve_args_model(args)
    tokenizer = AutoTokenizer.from_pretrained(model)
    scenarios = plan(args)
    peers, skipped = find_peers(args.peer, args, model, plan_needs(scenarios))
    prepared = [(s, rounds_of(s, tokenizer, args.repeats)) for s in scenarios]
    starters: dict[str, Callable[[], LaunchedServer]] = {
        "tidal": partial(LaunchedServer, model, args.server_arg)}
    for peer in peers:
        starters[peer.key] = partial(peer.start, model)
    kinds = list(starters)  # tidal first, then the peers in --peer's order
    if args.order == "peer-first":
        kinds = kinds[1:] + kinds[:1]
    load_start = os.getloadavg()
    reports: dict[str, dict[str, dict]] = {}
    runs: dict[str, dict] = {}
    for group in ([kinds] if args.interleave else [[kind] for kind in kinds]):
        run_servers({kind: starters[kind] for kind in group}, args, prepared, tokenizer,
                    reports, runs)
    skipped |= {kind: run["skipped"] for kind, run in runs.items() if "skipped" in run}
    ran = [kind for kind in kinds if kind in reports]
    result = {
        "setup": {
            "model": model, "model_params_m": model_params_m(model), "shape": args.shape,
            "tidal_args": args.server_arg, **peer_setup(peers, skipped),
            "load_average": [round(load_start[0], 2), round(os.getloadavg()[0], 2)],
            "cpu_count": os.cpu_count(), "notes": args.note, "argv": sys.argv[1:],
            "interleaved": args.interleave, "repeats": args.repeats,
            "scenario_warmup": args.scenario_warmup, "runs": runs},
        "scenarios": [asdict(s) | {"reports": {k: reports[k].get(s.name) for k in ran}}
                      for s in scenarios],
    }
    path = write_result(args.name, result)
    stored = json.loads(path.read_text())
    md = path.with_suffix(".md")
    md.write_text(markdown(stored) + "\n")
    print(markdown(stored))
    print(f"wrote {path} and {md}")
    if not args.no_plots:
        from bench.plots import plot_all

        for png in plot_all(path, RESULTS_DIR):
            print(f"wrote {png}")
    return path


def peer_setup(peers: list[Peer], skipped: dict[str, str]) -> dict[str, Any]:
    """The results' account of the peers: each one found (how it was started), each one
    skipped and why, and the first to run's ``peer_*`` entries, as results had them before
    there were several peers."""
    first = next((p for p in peers if p.key not in skipped), None)
    return {"peers": {p.key: p.describe() for p in peers}, "skipped_peers": skipped,
            "peer_name": first.name if first else None,
            "peer_version": first.version if first else None,
            "peer_args": first.args if first else None}


if __name__ == "__main__":
    main()
