"""What machine a GPU check ran on: GPU, driver, CUDA, torch, Triton, Python, the host CPU and
the commit, and the report's opening lines naming them."""

from __future__ import annotations

import subprocess
from importlib import import_module
from typing import Any


def nvidia_smi() -> tuple[str, str] | None:
    """(GPU name, driver version) of the first GPU from ``nvidia-smi``, if it answers."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    name, _, driver = done.stdout.splitlines()[0].partition(",") if done.stdout else ("", "", "")
    return (name.strip(), driver.strip()) if name.strip() else None


def collect_header(device: str) -> dict[str, Any]:
    """What ran the check (in a child: it initializes CUDA): GPU, driver, CUDA, torch, Triton,
    Python, the host CPU, the checkout's commit, and the results file's slug."""
    import torch

    from bench.common import machine
    from bench.decode_timing import device_slug

    info = machine()
    smi = nvidia_smi()
    driver = smi[1] if smi else None
    if driver is None and torch.cuda.is_available():
        try:
            api = torch._C._cuda_getDriverVersion()  # no public torch call gives the driver's
            driver = f"unknown (supports CUDA {api // 1000}.{api % 1000 // 10})"
        except (AttributeError, RuntimeError):
            driver = None
    try:
        triton = import_module("triton").__version__
    except ImportError:
        triton = "not installed"
    return {"gpu": info["gpu"] or (smi[0] if smi else None), "driver": driver,
            "cuda": torch.version.cuda, "torch": torch.__version__, "triton": triton,
            "python": info["python"], "cpu": info["cpu_model"], "cpu_cores": info["cpu_cores"],
            "platform": info["platform"], "commit": info["git_commit"],
            "slug": device_slug(device)}


def header_lines(header: dict[str, Any], commit: str | None, total_s: float | None,
                 budget_s: float) -> list[str]:
    gpu = header.get("gpu") or "none seen"
    wall = (f"{total_s:.0f} s of a {budget_s:.0f} s budget" if total_s is not None
            else "(running)")
    return [
        f"# GPU check: {gpu}", "",
        f"- GPU: {gpu}; driver {header.get('driver') or 'unknown'}; "
        f"CUDA {header.get('cuda') or 'none'}",
        f"- torch {header.get('torch', '?')}, Triton {header.get('triton', '?')}, "
        f"Python {header.get('python', '?')}",
        f"- commit: {commit or header.get('commit') or 'unknown'}",
        f"- date: {header.get('date', '?')}",
        f"- host CPU: {header.get('cpu', '?')}, {header.get('cpu_cores', '?')} cores "
        f"({header.get('platform', '?')})",
        f"- total wall time: {wall}",
    ]
