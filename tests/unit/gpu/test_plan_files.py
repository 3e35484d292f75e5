"""``tidal plans``: the CPU plan files shown, marked to be timed again, and cleared."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tidal.gpu.cpu import plan_files, selector
from tidal.gpu.cpu.selector import PlanCache, host_key


def _cache(directory: Path) -> PlanCache:
    """This host's plan file with two plans (one timed on a noisy host) for one model."""
    cache = PlanCache(directory, host_key(),
                      lambda name, fn, calls: {"a": 1.0, "b": 2.0}[name])
    plans = [cache.get_or_choose(key, [1, 2], lambda rows: {"a": lambda: 0, "b": lambda: 0})
             for key in ("op|x", "op|y")]
    cache.plans["op|y"] = selector.Plan((1, 2), ("a", "a"), noise=0.5, made_at=1.0)
    cache.record_model("model|x", plans)
    cache.save()
    return cache


def test_show_retime_and_clear(tmp_path: Path) -> None:
    _cache(tmp_path)
    shown = plan_files.run("show", tmp_path)
    assert "(this host)" in shown and "2 plans (1 provisional) for 1 models" in shown
    assert "marked 2 plans" in plan_files.run("retime", tmp_path)
    again = PlanCache(tmp_path, host_key())
    assert all(p.provisional for p in again.plans.values())
    assert again.knows_model("model|x")  # the next start serves on them, then times them
    assert sorted(again.forget_provisional()) == ["op|x", "op|y"]
    assert "cleared 1 plan file" in plan_files.run("clear", tmp_path)
    assert plan_files.plan_files(tmp_path) == []
    assert plan_files.run("show", tmp_path).startswith("no CPU plans")


def test_the_plans_command(tmp_path: Path) -> None:
    _cache(tmp_path)
    out = subprocess.run([sys.executable, "-m", "tidal", "plans"], capture_output=True,
                         text=True, env={**os.environ, selector.CACHE_ENV: str(tmp_path)},
                         check=True).stdout
    assert "1 provisional" in out and str(tmp_path) in out
