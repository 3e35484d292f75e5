"""Plots of a serving comparison: throughput and TTFT against concurrency, and latency CDFs.

    python -m bench.plots                                   # bench/results/serving_comparison.json
    python -m bench.plots bench/results/serving_comparison-quick.json

Writes ``<name>_throughput.png`` and ``<name>_latency.png`` beside the results.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.common import RESULTS_DIR  # noqa: E402

COLORS = {"tidal": "tab:blue", "transformers": "tab:red", "vllm": "tab:green",
          "llamacpp": "tab:orange"}
LINES = ("-", "--", ":", "-.")


def _style(server: str, index: int) -> dict[str, Any]:
    """Colour by server, line style by prompt length (or other series index)."""
    return {"color": COLORS.get(server, "tab:gray"), "linestyle": LINES[index % len(LINES)]}


def _fixed_scenarios(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The plain concurrency x prompt-length runs (no shared prefix, no long prompts)."""
    return [s for s in result["scenarios"] if not s["shared_prefix_len"] and not s["long_len"]]


def _servers(result: dict[str, Any]) -> list[str]:
    names: list[str] = []
    for scenario in result["scenarios"]:
        names += [n for n, rep in scenario["reports"].items() if rep and n not in names]
    return names


def throughput_plot(result: dict[str, Any], path: Path) -> Path:
    """Output tokens/s and median TTFT against concurrency, per server and prompt length."""
    fig, (ax_tput, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    fixed = _fixed_scenarios(result)
    for server in _servers(result):
        for index, input_len in enumerate(sorted({s["input_len"] for s in fixed})):
            runs = sorted((s for s in fixed if s["input_len"] == input_len
                           and s["reports"].get(server)), key=lambda s: s["concurrency"])
            if not runs:
                continue
            conc = [s["concurrency"] for s in runs]
            reps = [s["reports"][server]["classes"]["all"] for s in runs]
            label = f"{server}, {input_len}-token prompts"
            style = _style(server, index)
            ax_tput.plot(conc, [r["output_token_throughput_per_s"] for r in reps],
                         marker="o", label=label, **style)
            ax_ttft.plot(conc, [(r["ttft"] or {}).get("median_ms") for r in reps],
                         marker="o", label=label, **style)
    for ax, title, unit in ((ax_tput, "output throughput", "tokens/s"),
                            (ax_ttft, "median time to first token", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, result, path)


def _cdf(ax: Any, quantiles: list[float], label: str, style: dict[str, Any]) -> None:
    if quantiles:
        ax.plot(quantiles, [i / (len(quantiles) - 1) for i in range(len(quantiles))],
                label=label, **style)


def latency_plot(result: dict[str, Any], path: Path, concurrency: int | None = None) -> Path:
    """CDFs of TTFT and ITL at one concurrency, and of the short chats' ITL in the mixed
    workload."""
    fixed = _fixed_scenarios(result)
    levels = sorted({s["concurrency"] for s in fixed})
    if concurrency is None and levels:
        concurrency = max([c for c in levels if c <= 32] or levels)
    mixed = next((s for s in result["scenarios"] if s["long_len"]), None)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    lengths = sorted({s["input_len"] for s in fixed})
    for server in _servers(result):
        for s in fixed:
            rep = s["reports"].get(server)
            if s["concurrency"] != concurrency or not rep:
                continue
            q = rep["classes"]["all"].get("quantiles_ms", {})
            label = f"{server}, {s['input_len']}-token prompts"
            style = _style(server, lengths.index(s["input_len"]))
            _cdf(axes[0], q.get("ttft", []), label, style)
            _cdf(axes[1], q.get("itl", []), label, style)
        if mixed and mixed["reports"].get(server):
            q = mixed["reports"][server]["classes"]["short"].get("quantiles_ms", {})
            _cdf(axes[2], q.get("itl", []), server, _style(server, 0))
    titles = (f"TTFT at concurrency {concurrency}", f"inter-token latency at concurrency "
              f"{concurrency}", "short chats' ITL beside long prompts" if mixed else "")
    for ax, title in zip(axes, titles):
        ax.set_xscale("log")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    return _save(fig, result, path)


def _save(fig: Any, result: dict[str, Any], path: Path) -> Path:
    fig.suptitle(_title(result))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _title(result: dict[str, Any]) -> str:
    setup = result.get("setup", {})
    model = Path(str(setup.get("model", "?"))).name
    host = result.get("machine", {})
    cpu = host.get("gpu") or (f"{host['cpu_model']}, {host.get('cpu_cores')} cores"
                              if host.get("cpu_model") else host.get("device", ""))
    return f"{model} ({setup.get('model_params_m', '?')}M), {cpu}, {result.get('date', '')}"


def plot_all(result_path: Path, out_dir: Path = RESULTS_DIR) -> list[Path]:
    result = json.loads(Path(result_path).read_text())
    stem = Path(result_path).stem
    out_dir.mkdir(parents=True, exist_ok=True)
    return [throughput_plot(result, out_dir / f"{stem}_throughput.png"),
            latency_plot(result, out_dir / f"{stem}_latency.png")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="?", default=str(RESULTS_DIR / "serving_comparison.json"))
    ap.add_argument("--out-dir", default=None, help="default: beside the results")
    args = ap.parse_args()
    out = Path(args.out_dir) if args.out_dir else Path(args.results).parent
    for path in plot_all(Path(args.results), out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
