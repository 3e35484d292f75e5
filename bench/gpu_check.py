"""One prepared GPU check: what a lent GPU machine should tell us, in one Markdown file.

On a bare, offline GPU machine (tidal's dependencies already on ``PYTHONPATH``: it installs
nothing; an uninstalled checkout is made importable as ``tidal`` by a link) it runs, in under
eight minutes, each step in a child process with its own time limit, so a hung step is killed,
recorded as a failure, and the next one still runs:

1. ``packages``: every package of ``bench/gpu_packages.txt`` imports; a required one missing
   stops the check here;
2. ``suite``: the GPU test suite, ``TIDAL_TEST_DEVICE=cuda pytest -m gpu`` on 8 xdist workers;
3. ``roofline``: ``bench.decode_roofline`` on a reduced sweep (step, forward and roofline ms);
4. ``profile``: ``bench.kernel_profile``, the kernels of one eager decode step;
5. ``served``: ``python -m tidal serve --quantization int4`` (then int8) on the embedded model,
   asked for greedy completions with the official ``openai`` client, against the same prompts
   on the CPU (``core.LLM``).

Named with ``--only``, which the default run leaves out for its budget, the performance steps:
``matmul`` (``bench.matmul_roofline``: the decode GEMMs against their bytes and a prefill chunk
against the matmul rate), ``roofline-int4`` (the 1B shape with int4 linears),
``roofline-torch`` (the decode with torch's element-wise ops, ``TIDAL_GPU_KERNELS=off``: the
fused kernels' baseline) and ``throughput`` (``bench.offline_throughput``: ``LLM.generate``
against HF ``generate``).

The report, ``bench/results/gpu_check-<gpu>.md`` (and ``$OUT/gpu_check.md`` where ``OUT`` is
set), is rewritten after every step, so a run killed midway still leaves what it measured. The
suite's whole log goes to ``$OUT/gpu_suite.log``, each other step's to
``$OUT/gpu_check-<step>.log`` (a temporary directory without ``OUT``).

    python -m bench.gpu_check --commit SHA               # the whole check on a GPU machine
    python -m bench.gpu_check --packages                  # the wheels to carry, name==version
    python -m bench.gpu_check --only served --served int4
    python -m bench.gpu_check --only roofline --only profile --only matmul --only roofline-int4 \
        --only roofline-torch --only throughput      # the performance figures
    python -m bench.gpu_check --device cpu --skip suite   # a rehearsal on the CPU (tiny models)

The orchestrating process never initializes CUDA: the header (GPU, driver, versions) comes
from a child too, so a machine whose CUDA hangs still gets its report.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.gpu_header import collect_header, header_lines, nvidia_smi
from bench.gpu_packages import carried_requirements, check_packages, package_table, read_packages
from bench.processes import ROOT, CommandRun, run_command
from bench.pytest_summary import parse_pytest, suite_body
from bench.served_twins import NEAR_TIE, run_served, served_table

RESULTS_DIR = ROOT / "bench" / "results"
STEPS = ("packages", "suite", "roofline", "profile", "served")
# Further measurements, run when named with --only (beside the default steps they would not
# fit the default budget): a run of its own for the performance figures.
MORE_STEPS = ("matmul", "roofline-int4", "roofline-torch", "throughput")
BUDGET_S = 470.0  # the whole check, header included: under eight minutes
# Each step's own time limit, and the least a later step keeps back from the ones before it.
LIMITS_S = {"header": 60, "packages": 90, "suite": 300, "roofline": 150, "profile": 120,
            "matmul": 120, "roofline-int4": 90, "throughput": 150, "roofline-torch": 90,
            "served": 150}
RESERVES_S = {"header": 20, "packages": 20, "suite": 60, "roofline": 75, "profile": 45,
              "matmul": 45, "roofline-int4": 40, "throughput": 60, "roofline-torch": 40,
              "served": 60}
MIN_LIMIT_S = 5.0  # with less of the budget left, no step is started
SUITE_ARGS = ["-m", "gpu", "-rfEs", "-v", "-n", "8", "--dist", "loadfile",
              "-p", "no:cacheprovider"]
# About a minute on an H100 (two shapes' builds and graph captures, then 16 steps a batch).
ROOFLINE_ARGS = ["--shapes", "qwen2.5-0.5b,llama-3.2-1b", "--batches", "1,64,128", "--steps",
                 "16"]
# The same decode with its element-wise steps as torch's ops (the fused kernels' baseline),
# and the 1B shape's linears in int4 against their own roofline.
ROOFLINE_VARIANTS = {
    "roofline-torch": (["--shapes", "qwen2.5-0.5b,llama-3.2-1b", "--batches", "1,64",
                        "--steps", "16"], {"TIDAL_GPU_KERNELS": "off"}),
    "roofline-int4": (["--shapes", "llama-3.2-1b", "--batches", "1,64", "--steps", "16",
                       "--quantization", "int4"], {})}
MATMUL_ARGS = ["--shape", "llama-3.2-1b"]
# 512 prompts of 64-256 tokens, 128 out, through LLM.generate and through HF generate
THROUGHPUT_ARGS = ["--shape", "qwen2.5-0.5b", "--dtype", "bfloat16", "--num-prompts", "512",
                   "--max-num-seqs", "256", "--hf-batch-size", "128", "--no-floor"]
THROUGHPUT_CPU_ARGS = ["--num-prompts", "8", "--min-len", "8", "--max-len", "16",
                       "--output-len", "8", "--max-num-seqs", "8", "--hf-batch-size", "8",
                       "--no-floor"]
PROFILE_ARGS = ["--shape", "llama-3.2-1b", "--batch", "1", "--batch", "64"]


def child_command(child: str, json_path: Path, *args: str) -> list[str]:
    """This module in a child process doing one piece (``--child``), its result to JSON."""
    return [sys.executable, "-m", "bench.gpu_check", "--child", child, "--json",
            str(json_path), *args]


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# -- steps and the report ---------------------------------------------------------------------
@dataclass
class StepResult:
    name: str
    status: str  # "passed", "failed", "timeout" or "skipped"
    wall_s: float = 0.0
    limit_s: float = 0.0
    summary: str = ""  # one line, for the summary table
    body: str = ""  # the step's Markdown section
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Check:
    """One run of the check: its settings, where its logs go, and the results so far."""

    args: argparse.Namespace
    logs: Path
    # the children's JSON answers: kept out of ``logs`` ($OUT), whose files a GPU machine
    # sends back only up to a count
    scratch: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="gpu_check-")))
    header: dict[str, Any] = field(default_factory=dict)
    results: list[StepResult] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    @property
    def on_gpu(self) -> bool:
        return self.args.device.startswith("cuda")

    def log(self, name: str) -> Path:
        return self.logs / ("gpu_suite.log" if name == "suite" else f"gpu_check-{name}.log")

    def remaining_s(self) -> float:
        return self.args.budget - (time.monotonic() - self.started)

    def child_env(self) -> dict[str, str]:
        """A CPU rehearsal keeps torch's own CPU ops: no C++ kernel build, no timing of them."""
        return {} if self.on_gpu else {"TIDAL_CPU_KERNELS": "off"}


def report_path(out_dir: Path, slug: str) -> Path:
    return out_dir / f"gpu_check-{slug}.md"


def render_report(check: Check, done: bool = False) -> str:
    total = time.monotonic() - check.started if done else None
    lines = header_lines(check.header, check.args.commit, total, check.args.budget)
    lines += ["", "| step | result | wall s | limit s | summary |", "|---|---|---:|---:|---|"]
    lines += [f"| {r.name} | {r.status} | {r.wall_s:.1f} | {r.limit_s:.0f} | "
              f"{r.summary.replace('|', '/')} |" for r in check.results]
    for r in check.results:
        lines += ["", f"## {r.name}: {r.status} ({r.wall_s:.1f} s)", "", r.summary]
        if r.body:
            lines += ["", r.body.rstrip()]
    return "\n".join(lines) + "\n"


def write_report(check: Check, done: bool = False) -> list[Path]:
    """The report to the results directory, and to ``$OUT/gpu_check.md`` where OUT is set."""
    text = render_report(check, done)
    paths = [report_path(Path(check.args.out_dir), check.header.get("slug") or "unknown-gpu")]
    if os.environ.get("OUT"):
        paths.append(Path(os.environ["OUT"]) / "gpu_check.md")
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return paths


def failed_run(name: str, run: CommandRun, limit_s: float, what: str) -> StepResult:
    """A child that timed out, or exited non-zero: the tail of its log."""
    tail = "\n".join(run.output.rstrip().splitlines()[-25:])
    status, summary = (("timeout", f"killed at its {limit_s:.0f} s limit") if run.timed_out
                       else ("failed", f"{what} exited with {run.returncode}"))
    return StepResult(name, status, run.wall_s, limit_s, f"{summary} (log: {run.log})",
                      f"```\n{tail}\n```" if tail else "")


# -- 1. packages ------------------------------------------------------------------------------
def step_packages(check: Check, limit_s: float) -> StepResult:
    out = check.scratch / "packages.json"
    run = run_command(child_command("packages", out), limit_s, check.log("packages"))
    statuses = read_json(out)
    if statuses is None:
        return failed_run("packages", run, limit_s, "the package check")
    missing = [s["package"]["name"] for s in statuses
               if s["error"] and not s["package"]["optional"]]
    optional = [s["package"]["name"] for s in statuses
                if s["error"] and s["package"]["optional"]]
    other = sum(1 for s in statuses if not s["error"] and s["found"] != s["package"]["version"])
    summary = (f"{len(statuses)} listed: {len(missing)} required missing"
               f"{' (' + ', '.join(missing) + ')' if missing else ''}, {len(optional)} optional "
               f"missing{' (' + ', '.join(optional) + ')' if optional else ''}, {other} at "
               "another version")
    return StepResult("packages", "failed" if missing else "passed", run.wall_s, limit_s,
                      summary, package_table(statuses), {"missing": missing})


# -- 2. the GPU test suite --------------------------------------------------------------------
def step_suite(check: Check, limit_s: float) -> StepResult:
    cmd = [sys.executable, "-m", "pytest", *SUITE_ARGS, *shlex.split(check.args.suite_args)]
    run = run_command(cmd, limit_s, check.log("suite"), {"TIDAL_TEST_DEVICE": check.args.device})
    outcome = parse_pytest(run.output)
    counts = ", ".join(f"{n} {w}" for w, n in outcome.counts.items()) or "no counts"
    if run.timed_out:
        status, how = "timeout", f"killed at its {limit_s:.0f} s limit, counts so far"
    else:
        status = "passed" if run.returncode == 0 else "failed"
        how = f"pytest exited with {run.returncode}"
    summary = f"{counts} ({how}; `{shlex.join(['python', *cmd[1:]])}`; log: {run.log})"
    body = suite_body(outcome)
    if status != "passed" and not outcome.failures:  # a crash or a hang: show where it was
        body += "\n\n```\n" + "\n".join(run.output.rstrip().splitlines()[-25:]) + "\n```"
    return StepResult("suite", status, run.wall_s, limit_s, summary, body.strip(),
                      {"counts": outcome.counts})


# -- 3. the roofline table ---------------------------------------------------------------------
def roofline_table(result: dict[str, Any]) -> str:
    bandwidth = result.get("copy_bandwidth_bytes_per_s", 0) / 1e9
    lines = [f"Copy bandwidth {bandwidth:.0f} GB/s.", "",
             "| shape | batch | context | step ms | forward ms | roofline ms | step / roofline "
             "| forward / roofline |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for shape, entry in result.get("shapes", {}).items():
        for r in entry["rows"]:
            lines.append(f"| {shape} | {r['batch']} | {r['context']} | {r['step_ms']:.3f} | "
                         f"{r['forward_ms']:.3f} | {r['roofline_ms']:.3f} | "
                         f"{r['step_over_roofline']:.2f}x | {r['forward_over_roofline']:.2f}x |")
    return "\n".join(lines)


def step_roofline(check: Check, limit_s: float, name: str = "roofline") -> StepResult:
    """``bench.decode_roofline`` on a reduced sweep (``name``: the main one or one of
    ``ROOFLINE_VARIANTS``). It writes its JSON among the committed results; the full sweep's
    file there is put back afterwards, and this run's copied to OUT."""
    if name == "roofline":
        args = (shlex.split(check.args.roofline_args) if check.args.roofline_args
                else ROOFLINE_ARGS)
        env: dict[str, str] = {}
    else:
        args, env = ROOFLINE_VARIANTS[name]
    cmd = [sys.executable, "-m", "bench.decode_roofline", *args, "--device", check.args.device,
           *([] if check.on_gpu else ["--tiny"])]
    run, result = run_writing_result(check, name, cmd, limit_s, "decode_roofline", env)
    if result is None:
        return failed_run(name, run, limit_s, "bench.decode_roofline")
    rows = [r for entry in result["shapes"].values() for r in entry["rows"]]
    worst = max(r["forward_over_roofline"] for r in rows)
    return StepResult(name, "passed", run.wall_s, limit_s,
                      f"{len(rows)} rows (`{shlex.join(args)}`{env_text(env)}); forward at "
                      f"most {worst:.2f}x its roofline", roofline_table(result),
                      {"shapes": result["shapes"]})


def env_text(env: dict[str, str]) -> str:
    return "".join(f", {k}={v}" for k, v in env.items())


def run_writing_result(check: Check, name: str, cmd: list[str], limit_s: float, bench: str,
                       env: dict[str, str]) -> tuple[CommandRun, dict[str, Any] | None]:
    """Run a benchmark that writes ``bench/results/<bench>-*.json`` and says ``wrote PATH``:
    its result, with the committed results files as they were before (the check's figures go
    to its report and to OUT, not over a full sweep's file)."""
    before = {p: p.read_bytes() for p in RESULTS_DIR.glob(f"{bench}-*.json")}
    run = run_command(cmd, limit_s, check.log(name), {**check.child_env(), **env})
    wrote = re.findall(r"^wrote (.+\.json)$", run.output, re.M)
    result = read_json(Path(wrote[-1])) if wrote and run.returncode == 0 else None
    for path in RESULTS_DIR.glob(f"{bench}-*.json"):
        if path in before:
            path.write_bytes(before[path])
        else:
            path.unlink()
    if result is not None and os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / f"gpu_check-{name}.json").write_text(json.dumps(result))
    return run, result


def step_matmul(check: Check, limit_s: float) -> StepResult:
    """``bench.matmul_roofline``: the decode GEMMs against their bytes, a prefill chunk
    against the matmul rate."""
    cmd = [sys.executable, "-m", "bench.matmul_roofline", *MATMUL_ARGS, "--device",
           check.args.device, *([] if check.on_gpu else ["--tiny"])]
    run, result = run_writing_result(check, "matmul", cmd, limit_s, "matmul_roofline", {})
    if result is None:
        return failed_run("matmul", run, limit_s, "bench.matmul_roofline")
    prefill = result.get("prefill") or {}
    low = min(result["gemms"], key=lambda r: r["of_copy_rate"])
    summary = (f"GEMMs at {low['of_copy_rate']:.0%} of the copy rate or more (least: "
               f"{low['gemm']} at batch {low['batch']}); prefill of {prefill.get('tokens')} "
               f"tokens at {prefill.get('of_matmul_rate', 0):.0%} of the matmul rate "
               f"({result['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s)")
    return StepResult("matmul", "passed", run.wall_s, limit_s, summary, matmul_table(result),
                      result)


def step_throughput(check: Check, limit_s: float) -> StepResult:
    """``bench.offline_throughput``: the same prompts through ``LLM.generate`` and HF's
    ``generate`` on the device, each in a fresh process."""
    args = THROUGHPUT_ARGS if check.on_gpu else THROUGHPUT_CPU_ARGS
    cmd = [sys.executable, "-m", "bench.offline_throughput", *args, "--device",
           check.args.device, "--name", "offline_throughput-gpu-check"]
    run, result = run_writing_result(check, "throughput", cmd, limit_s, "offline_throughput",
                                     {})
    if result is None:
        return failed_run("throughput", run, limit_s, "bench.offline_throughput")
    ours, hf = result["tidal"], result["hf_generate"]
    summary = (f"{result['ratio_output_tok_per_s']:.2f}x HF generate "
               f"({ours['output_tok_per_s']:.0f} vs {hf['output_tok_per_s']:.0f} output tok/s; "
               f"`{shlex.join(args)}`)")
    phases = ", ".join(f"{k} {v:.2f}" for k, v in ours.get("step_ms", {}).items())
    body = (f"{summary}.\n\ntidal: {ours['seconds']:.2f} s, {ours.get('steps')} steps; "
            f"ms per step: {phases}.")
    return StepResult("throughput", "passed", run.wall_s, limit_s, summary, body,
                      {"tidal": ours, "hf_generate": hf})


def matmul_table(result: dict[str, Any]) -> str:
    lines = [f"Copy bandwidth {result['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s; "
             f"{result['settings']['dtype']} matmul rate "
             f"{result['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s.", "",
             "| GEMM | out x in | batch | us | GB/s | of the copy rate |",
             "|---|---|---:|---:|---:|---:|"]
    for r in result["gemms"]:
        lines.append(f"| {r['gemm']} | {r['out_features']}x{r['in_features']} | {r['batch']} "
                     f"| {r['us']:.1f} | {r['bytes_per_s'] / 1e9:.0f} | "
                     f"{r['of_copy_rate']:.0%} |")
    prefill = result.get("prefill")
    if prefill:
        lines += ["", f"Prefill of {prefill['tokens']} tokens: {prefill['ms']:.2f} ms, "
                  f"{prefill['flops_per_s'] / 1e12:.0f} TFLOP/s, "
                  f"{prefill['of_matmul_rate']:.0%} of the matmul rate."]
    return "\n".join(lines)


# -- 4. the kernel profile ---------------------------------------------------------------------
def step_profile(check: Check, limit_s: float) -> StepResult:
    out = Path(os.environ.get("OUT") or check.logs) / "gpu_check-profile.json"
    args = shlex.split(check.args.profile_args) if check.args.profile_args else PROFILE_ARGS
    cmd = [sys.executable, "-m", "bench.kernel_profile", *args, "--device", check.args.device,
           "--json", str(out), *([] if check.on_gpu else ["--tiny", "--cpu-kernels", "off"])]
    run = run_command(cmd, limit_s, check.log("profile"), check.child_env())
    result = read_json(out) if run.returncode == 0 else None
    if result is None:
        return failed_run("profile", run, limit_s, "bench.kernel_profile")
    from bench.kernel_profile import markdown

    if check.on_gpu and not all(b["kernels"] for b in result["batches"]):
        return StepResult("profile", "failed", run.wall_s, limit_s, "the profiler recorded no "
                          "CUDA kernels (is CUPTI usable here?)", markdown(result), result)
    summary = "; ".join(f"batch {b['batch']}: {b['kernels']} {result['unit']}s, "
                        f"{b['kernel_us']:.0f} of {b['profiled_wall_us']:.0f} us busy"
                        for b in result["batches"])
    return StepResult("profile", "passed", run.wall_s, limit_s, summary, markdown(result),
                      result)


def step_served(check: Check, limit_s: float) -> StepResult:
    out = check.scratch / "served.json"
    out.unlink(missing_ok=True)
    run = run_command(child_command("served", out, "--device", check.args.device, "--served",
                                    check.args.served, "--served-dtype",
                                    check.args.served_dtype),
                      limit_s, check.log("served"), check.child_env())
    runs = read_json(out) or []
    if not runs:
        return failed_run("served", run, limit_s, "the served comparison")
    same = "; ".join(f"{r['quantization']}: {sum(c['same_text'] for c in r['comparisons'])}/"
                     f"{len(r['comparisons'])} texts alike" for r in runs)
    agree = all(c["agrees"] for r in runs for c in r["comparisons"])
    body = "\n\n".join(served_table(r) for r in runs)
    if run.returncode != 0:  # the first quantizations ran, a later one failed or hung
        partial = failed_run("served", run, limit_s, "the served comparison")
        return StepResult("served", partial.status, run.wall_s, limit_s,
                          f"{same}; then {partial.summary}", f"{body}\n\n{partial.body}",
                          {"runs": runs})
    if not agree:
        same += f" (a text left its twin away from a near tie, {NEAR_TIE} nats)"
    return StepResult("served", "passed" if agree else "failed", run.wall_s, limit_s, same,
                      body, {"runs": runs})


# -- running the steps ------------------------------------------------------------------------
@dataclass
class Step:
    name: str
    run: Callable[[Check, float], StepResult]


STEP_FUNCTIONS: dict[str, Callable[[Check, float], StepResult]] = {
    "packages": step_packages, "suite": step_suite, "roofline": step_roofline,
    "profile": step_profile, "matmul": step_matmul, "throughput": step_throughput,
    **{name: functools.partial(step_roofline, name=name) for name in ROOFLINE_VARIANTS},
    "served": step_served}


def step_limit(check: Check, name: str, later: list[str]) -> float:
    """The step's own limit, cut to what the budget leaves once each later step keeps its
    reserve back (never below this step's own reserve while the budget lasts)."""
    remaining = check.remaining_s()
    limits = {**LIMITS_S, **check.args.limit}
    kept = sum(RESERVES_S.get(s, 0) for s in later)
    return min(limits[name], max(remaining - kept, min(RESERVES_S.get(name, 0), remaining)))


def run_header(check: Check) -> None:
    out = check.scratch / "header.json"
    limit = step_limit(check, "header", [])
    run = run_command(child_command("header", out, "--device", check.args.device), limit,
                      check.log("header"))
    header = read_json(out) or {"slug": "unknown-gpu" if check.on_gpu else "cpu",
                                "error": f"the header child failed (log: {run.log})"}
    smi = nvidia_smi() if header.get("gpu") is None else None
    if smi:
        header["gpu"], header["driver"] = smi
    check.header = {**header, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def run_steps(check: Check, steps: list[Step]) -> list[StepResult]:
    """Each step in turn under its limit, the report rewritten after each. A required package
    missing, or the budget spent, leaves the later steps skipped."""
    stop: str | None = None
    for i, step in enumerate(steps):
        limit = step_limit(check, step.name, [s.name for s in steps[i + 1:]])
        if stop is None and check.remaining_s() < MIN_LIMIT_S:
            stop = f"the {check.args.budget:.0f} s budget is spent"
        if stop is not None:
            result = StepResult(step.name, "skipped", summary=f"not run: {stop}")
        else:
            print(f"gpu_check: {step.name} (limit {limit:.0f} s)", flush=True)
            result = step.run(check, limit)
            if step.name == "packages" and result.data.get("missing"):
                stop = "a required package is missing"
        check.results.append(result)
        print(f"gpu_check: {result.name} {result.status} in {result.wall_s:.1f} s: "
              f"{result.summary}", flush=True)
        write_report(check)
    return check.results


def selected_steps(args: argparse.Namespace) -> list[Step]:
    names = [s for s in (*STEPS, *MORE_STEPS)
             if (s in args.only if args.only else s in STEPS) and s not in args.skip]
    return [Step(name, STEP_FUNCTIONS[name]) for name in names]


def parse_limit(text: str) -> tuple[str, float]:
    name, _, seconds = text.partition("=")
    if name not in LIMITS_S or not seconds:
        raise argparse.ArgumentTypeError(f"expected STEP=SECONDS, STEP one of {LIMITS_S}: {text!r}")
    return name, float(seconds)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--packages", nargs="?", const="carry", choices=["carry", "all"],
                    help="print the packages' name==version lines and exit: the wheels to carry "
                    "(default), or all of them with the preinstalled ones")
    ap.add_argument("--skip", action="append", default=[], choices=(*STEPS, *MORE_STEPS),
                    metavar="STEP",
                    help=f"leave out a step, repeatable: {', '.join(STEPS)}")
    ap.add_argument("--only", action="append", default=[], choices=(*STEPS, *MORE_STEPS),
                    metavar="STEP", help="run only this step, repeatable; also "
                    f"{', '.join(MORE_STEPS)}, which the default run leaves out")
    ap.add_argument("--device", default="cuda", help="'cpu' rehearses the check on tiny models")
    ap.add_argument("--commit", help="the commit checked (default: git rev-parse HEAD)")
    ap.add_argument("--out-dir", default=str(RESULTS_DIR), help="where the report goes")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole check")
    ap.add_argument("--limit", type=parse_limit, action="append", default=[],
                    metavar="STEP=SECONDS", help="a step's own limit, repeatable "
                    f"(defaults: {', '.join(f'{k} {v}' for k, v in LIMITS_S.items())})")
    ap.add_argument("--suite-args", default="", help="more pytest arguments, one string")
    ap.add_argument("--roofline-args", default="", help="bench.decode_roofline's arguments, "
                    f"one string (default: {shlex.join(ROOFLINE_ARGS)})")
    ap.add_argument("--profile-args", default="", help="bench.kernel_profile's arguments, one "
                    f"string (default: {shlex.join(PROFILE_ARGS)})")
    ap.add_argument("--served", default="int4,int8", help="quantizations served, in turn")
    ap.add_argument("--served-dtype", default="float32",
                    help="the served model's --dtype, the CPU twin's float32 by default")
    ap.add_argument("--child", choices=["header", "packages", "served"], help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.limit = dict(args.limit)
    return args


def run_child(args: argparse.Namespace) -> None:
    """One piece of the check in this (child) process, its result to ``--json``."""
    if args.child == "header":
        args.json.write_text(json.dumps(collect_header(args.device)))
    elif args.child == "packages":
        statuses = check_packages(read_packages())
        args.json.write_text(json.dumps([asdict(s) for s in statuses]))
    else:
        run_served(args.device, args.served.split(","), args.served_dtype, args.json)


def importable_checkout() -> None:
    """Make this checkout importable as ``tidal`` where it is not installed (a bare GPU machine):
    a ``tidal`` link to the repository's root in a temporary folder, put on ``PYTHONPATH`` for
    the children and on ``sys.path`` for this process."""
    import importlib.util

    if importlib.util.find_spec("tidal") is not None:
        return
    folder = Path(tempfile.mkdtemp(prefix="tidal-import-"))
    (folder / "tidal").symlink_to(ROOT, target_is_directory=True)
    sys.path.insert(0, str(folder))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    importable_checkout()
    if args.packages:
        print("\n".join(carried_requirements(read_packages(), args.packages == "all")))
        return 0
    if args.child:
        run_child(args)
        return 0
    logs = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu_check-"))
    check = Check(args, logs)
    run_header(check)
    write_report(check)
    run_steps(check, selected_steps(args))
    paths = write_report(check, done=True)
    print(f"gpu_check: done in {time.monotonic() - check.started:.0f} s; wrote "
          f"{', '.join(map(str, paths))}")
    return 0 if all(r.status == "passed" for r in check.results) else 1


if __name__ == "__main__":
    sys.exit(main())
