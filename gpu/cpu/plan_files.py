"""``tidal plans``: the CPU plan files kept in the cache directory (``selector.PlanCache``),
shown, marked to be timed again, or cleared.

A file holds one host's plans (its CPU, flags, torch, kernel build and thread count). Marking
plans to be timed again makes them provisional: the next server start serves on them and times
them again once its engine idles (``model_upgrade``), rather than timing them before it serves.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tidal.gpu.cpu.selector import NOISY, cache_dir, host_key

# a noise past any threshold: what marks a plan to be timed again
RETIME_NOISE = 1e9


def plan_files(directory: Path | None = None) -> list[Path]:
    return sorted((directory or cache_dir()).glob("cpu_plans-*.json"))


def describe(path: Path, this_host: dict[str, str] | None = None) -> str:
    """A few lines on one file: whose plans, how many, how noisy, when timed."""
    try:
        data = json.loads(path.read_text())
        host, plans, models = data["host"], data["plans"], data.get("models", {})
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{path}: unreadable ({exc})"
    mine = " (this host)" if this_host is not None and host == this_host else ""
    noisy = sum(1 for p in plans.values() if p.get("noise", 0.0) > NOISY)
    made = [p.get("made_at", 0) for p in plans.values() if p.get("made_at")]
    loads = [p["load"] for p in plans.values() if p.get("load") is not None]
    lines = [f"{path}{mine}",
             f"  host: {host.get('cpu')}, {host.get('threads')} threads, torch "
             f"{host.get('torch')}, kernels {host.get('kernels')}",
             f"  {len(plans)} plans ({noisy} provisional) for {len(models)} models"]
    if made:
        lines.append(f"  timed {_when(min(made))} to {_when(max(made))}"
                     + (f", load per core {min(loads):.2f}-{max(loads):.2f}" if loads else ""))
    return "\n".join(lines)


def mark_for_retiming(path: Path) -> int:
    """Make every plan in ``path`` provisional; how many."""
    data = json.loads(path.read_text())
    for plan in data["plans"].values():
        plan["noise"] = RETIME_NOISE
    for model in data.get("models", {}).values():
        model["provisional"] = True
    _write(path, data)
    return len(data["plans"])


def run(action: str, directory: Path | None = None) -> str:
    """``show``, ``retime`` or ``clear`` every plan file; what was done, for the terminal."""
    files = plan_files(directory)
    where = directory or cache_dir()
    if not files:
        return f"no CPU plans in {where}"
    if action == "clear":
        for path in files:
            path.unlink(missing_ok=True)
        return f"cleared {len(files)} plan file(s) in {where}: the next start times its plans"
    if action == "retime":
        count = sum(mark_for_retiming(path) for path in files)
        return (f"marked {count} plans to be timed again: the next start serves on them and "
                "times them again once idle")
    key = host_key()
    return "\n".join(describe(path, key) for path in files)


def _when(stamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(stamp))


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
