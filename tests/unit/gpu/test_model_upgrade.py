"""A first start with no build of the CPU kernels on the machine: the engine serves on torch's
paths at once while they build in the background, then swaps in a model planned on them
between two steps, and the tokens go on as they would have on either path."""

from __future__ import annotations

import threading
import time

import pytest

from tidal.core.config import DEFAULT_MODEL, EngineConfig
from tidal.core.engine_core import EngineCore
from tidal.core.sampling_params import SamplingParams
from tidal.gpu import model_runner
from tidal.gpu.attention import CpuAttentionBackend, TorchAttentionBackend
from tidal.gpu.cpu import kernels, model_upgrade, selector

pytestmark = pytest.mark.skipif(kernels.load_cpu_kernels() is None,
                                reason="needs the C++ kernels")


def _greedy(engine: EngineCore, prompt: list[int], tokens: int, before_step=None) -> list[int]:
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=tokens,
                                                   ignore_eos=True))
    out: list[int] = []
    steps = 0
    while engine.has_unfinished_requests():
        if before_step is not None:
            before_step(steps)
        for delta in engine.step():
            out += delta.outputs[0].token_ids
        steps += 1
    return out


@pytest.mark.slow
def test_serves_on_torch_while_kernels_build_then_swaps_them_in(monkeypatch) -> None:
    built = kernels._build_and_load()  # the real kernels, already built by this process
    release = threading.Event()

    def slow_build():
        release.wait(timeout=60)
        return built

    monkeypatch.setattr(selector, "_mode", None)  # the engines below set it; restored after
    monkeypatch.setattr(kernels, "_background", None)
    monkeypatch.setattr(kernels, "_build_and_load", slow_build)
    monkeypatch.setattr(model_upgrade, "is_built", lambda: False)
    config = EngineConfig(model=DEFAULT_MODEL, max_model_len=128, cpu_kernels="auto")
    engine = EngineCore(config)
    _ENGINES.append(engine)
    runner = engine.executor.runner
    assert kernels.load_cpu_kernels() is None  # torch's paths meanwhile
    first_model = runner.model
    assert isinstance(first_model.layers[0].self_attn.backend, TorchAttentionBackend)
    assert runner.cpu.stack is None

    swapped_at = []

    def at_step(step: int) -> None:
        if step == 3:
            release.set()
            runner._upgrades.pending.future.result(timeout=120)  # the model on the kernels is ready
        if runner.model is not first_model and not swapped_at:
            swapped_at.append(step)

    prompt = list(range(5, 25))
    tokens = _greedy(engine, prompt, 12, at_step)
    assert swapped_at == [4]  # prepared before step 3, swapped in as step 3 launched
    upgrades = runner._upgrades  # nothing more to wait for, unless plans are timed again
    assert upgrades.waiting is None and (upgrades.pending is None or upgrades.retiming)
    assert kernels.load_cpu_kernels() is built
    assert isinstance(runner.model.layers[0].self_attn.backend, CpuAttentionBackend)

    reference = EngineCore(EngineConfig(model=DEFAULT_MODEL, max_model_len=128,
                                        cpu_kernels="off"))
    assert tokens == _greedy(reference, prompt, 12)


def test_a_finished_build_is_imported_without_the_builder(monkeypatch, tmp_path) -> None:
    """A finished build loads as it is, never through torch's builder (which would compile it
    all again if torch's headers were newer); one that does not import is built again."""
    import torch.utils.cpp_extension as cpp_extension

    if kernels.load_cpu_kernels() is None:
        pytest.skip("no build of the kernels on this host")
    built = kernels._build_dir() / f"{kernels.build_name()}.so"
    calls: list[str] = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: calls.append(kw["name"]))
    module = kernels._build_and_load.__wrapped__()
    assert calls == [] and module is not None and hasattr(module, "dot_linear_tile")
    (tmp_path / built.name).write_bytes(b"not a shared object")
    monkeypatch.setattr(kernels, "_build_dir", lambda: tmp_path)
    assert kernels._build_and_load.__wrapped__() is None and calls == [kernels.build_name()]


def test_a_build_for_another_torch_is_another_build(monkeypatch) -> None:
    """The name a finished build is imported by covers torch's version: a build linked
    against another torch's ABI is never imported as it is."""
    import torch

    name = kernels.build_name()
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert kernels.build_name() != name


def test_a_build_lock_left_by_a_dead_builder_is_cleared(monkeypatch, tmp_path) -> None:
    """A server killed during its first build leaves torch's lock; the next start must not
    wait on it forever. A lock whose builder is alive, or one too fresh to judge, stays."""
    import os
    import subprocess
    import sys

    monkeypatch.setattr(kernels, "_build_dir", lambda: tmp_path)
    lock, owner = tmp_path / "lock", tmp_path / kernels.BUILDER_FILE
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    lock.touch()
    owner.write_text(str(os.getpid()))  # alive: its build goes on
    kernels._clear_stale_lock()
    assert lock.exists()
    owner.write_text(dead)
    kernels._clear_stale_lock()
    assert not lock.exists()
    lock.touch()
    owner.unlink()  # nobody claims it, and it is fresh
    kernels._clear_stale_lock()
    assert lock.exists()
    old = lock.stat().st_mtime - kernels.STALE_LOCK_SECONDS - 1
    os.utime(lock, (old, old))
    kernels._clear_stale_lock()
    assert not lock.exists()


# -- plans timed in the background, and timed again once the host is quiet --------------------
_ENGINES: list[EngineCore] = []


@pytest.fixture(autouse=True)
def _shut_down_engines():
    """No engine's background re-time outlives its test."""
    yield
    while _ENGINES:
        _ENGINES.pop().shutdown()


def _engine(max_model_len: int = 96) -> EngineCore:
    engine = EngineCore(EngineConfig(model=DEFAULT_MODEL, max_model_len=max_model_len,
                                     cpu_kernels="auto", max_num_seqs=4))
    _ENGINES.append(engine)
    return engine


def _scripted(slower: str, noise: float):
    """A timer that runs each call once but reports made-up times: 1 ms, 3 ms for
    ``slower``'s kind (torch's paths, or all the others with ``slower="others"``), each round
    up to ``noise`` longer at random: a co-tenant that comes and goes, or (no noise) a
    quiet host where that kind loses."""
    import random

    rng = random.Random(0)

    def timer(name, fn, calls):
        fn()
        ms = 3.0 if (name == selector.TORCH) == (slower == "torch") else 1.0
        return ms * (1 + noise * rng.random())

    return timer


def test_a_new_model_serves_on_defaults_while_its_plans_are_timed(monkeypatch, tmp_path):
    monkeypatch.setenv(selector.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(selector, "_mode", None)
    engine = _engine()
    runner = engine.executor.runner
    assert runner._upgrades.waiting == "plans" and not runner.cpu.plans.timed
    assert "timed in the background" in runner.kernel_summary()
    untimed = runner.model
    runner._upgrades.pending.future.result(timeout=300)
    trims = []  # the replaced model's memory handed back to the OS once it is swapped out
    monkeypatch.setattr(model_runner, "release_freed_host_memory", lambda: trims.append(1))
    tokens = _greedy(engine, list(range(5, 25)), 10)
    assert runner.model is not untimed and runner.cpu.plans.timed  # swapped at the first step
    assert trims == [1]
    assert runner._upgrades.waiting is None
    reference = EngineCore(EngineConfig(model=DEFAULT_MODEL, max_model_len=96,
                                        cpu_kernels="off"))
    assert tokens == _greedy(reference, list(range(5, 25)), 10)
    # the next start of the same model reads its plans back: nothing in the background
    again = _engine().executor.runner
    assert again._upgrades.waiting is None and again.cpu.plans.timed
    assert again.cpu.plans.measured == 0


def test_plans_timed_under_load_are_timed_again_when_quiet_and_swapped(monkeypatch, tmp_path):
    monkeypatch.setenv(selector.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(selector, "_mode", None)
    # long enough for the quiet timer below to be in place before the re-time starts
    monkeypatch.setattr(model_upgrade, "RETIME_AFTER_S", 3.0)
    monkeypatch.setattr(model_upgrade, "IDLE_S", 0.2)
    # a co-tenant while the first plans are timed: torch's paths look fastest, and noisy
    monkeypatch.setattr(selector, "host_timer", _scripted("others", 1.0))
    engine = _engine()
    runner = engine.executor.runner
    runner._upgrades.pending.future.result(timeout=300)
    prompt = list(range(5, 25))
    before = _greedy(engine, prompt, 6)
    loaded_plans = runner.cpu.plans.plans
    assert any(p.provisional for p in loaded_plans.values())
    assert runner._upgrades.retiming  # it waits for the engine to idle
    assert runner.kernel_summary().endswith("noisy plans to be timed again once idle")
    # quiet now: the re-time finds the kernels faster, and the model is swapped
    monkeypatch.setattr(selector, "host_timer", _scripted("torch", 0.0))
    runner._upgrades.pending.future.result(timeout=300)
    after = _greedy(engine, prompt, 6)
    assert runner.cpu.plans.plans != loaded_plans
    assert not any(p.provisional for p in runner.cpu.plans.plans.values())
    assert selector.KERNELS in runner.cpu.plans.plans["rms_norm"].used()
    assert runner._upgrades.pending is None  # nothing left to time
    assert after == before  # greedy tokens unchanged across the swap


def test_the_step_watch_trips_on_persistently_slow_windows(monkeypatch) -> None:
    from tidal.gpu.cpu import step_watch

    monkeypatch.setattr(step_watch, "WINDOW", 4)
    monkeypatch.setattr(step_watch, "PERSIST", 2)
    watch = step_watch.StepWatch()
    assert not any(watch.observe(2, 100, 1.0) for _ in range(4))  # the baseline: 1 ms
    assert not any(watch.observe(2, 100, 1.2) for _ in range(8))  # near enough
    assert not any(watch.observe(2, 900, 5.0) for _ in range(12))  # a longer context: its own
    assert not any(watch.observe(2, 100, 3.0) for _ in range(4))  # one slow window
    assert not any(watch.observe(2, 100, 1.0) for _ in range(4))  # then a good one
    slow = [watch.observe(2, 100, 3.0) for _ in range(8)]  # two slow windows in a row
    assert slow == [False] * 7 + [True] and watch.baseline == {}  # afresh after it trips


@pytest.mark.slow
def test_steps_slower_than_when_the_plans_came_in_have_them_timed_again(monkeypatch,
                                                                         tmp_path) -> None:
    import time

    from tidal.gpu.cpu import step_watch

    monkeypatch.setenv(selector.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(selector, "_mode", None)
    monkeypatch.setattr(model_upgrade, "RETIME_AFTER_S", 0.2)
    monkeypatch.setattr(model_upgrade, "IDLE_S", 0.2)
    monkeypatch.setattr(step_watch, "WINDOW", 4)
    monkeypatch.setattr(step_watch, "PERSIST", 2)
    monkeypatch.setattr(selector, "host_timer", _scripted("others", 0.0))  # quiet plans
    engine = _engine()
    runner = engine.executor.runner
    runner._upgrades.pending.future.result(timeout=300)
    prompt = list(range(5, 25))
    before = _greedy(engine, prompt, 8)  # swaps the timed model in; the steps' baseline
    planned = runner.cpu.plans.plans
    assert runner._upgrades.pending is None
    run_model = runner.run_model

    def co_tenant(*args):  # every step now takes 100 ms longer
        time.sleep(0.1)
        return run_model(*args)

    monkeypatch.setattr(runner, "run_model", co_tenant)
    monkeypatch.setattr(selector, "host_timer", _scripted("torch", 0.0))
    tokens = _greedy(engine, prompt, 24)
    assert runner._upgrades.retiming  # the watch tripped: timed again once idle
    runner._upgrades.pending.future.result(timeout=300)
    after = _greedy(engine, prompt, 24)
    assert runner.cpu.plans.plans != planned  # swapped for the plans timed again
    assert after == tokens and tokens[:8] == before


def _served_on_noisy_plans(monkeypatch, tmp_path, retime_slower: str = "others"):
    """An engine whose first plans were timed noisy (torch's paths fastest), served a request
    and waiting to time them again, where ``retime_slower``'s kind will lose (noisy too):
    (engine, runner). The timer is set before the request, whose swap schedules the re-time:
    set after, a busy host could let the re-time start on the first one."""
    monkeypatch.setenv(selector.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(selector, "_mode", None)
    monkeypatch.setattr(model_upgrade, "RETIME_AFTER_S", 0.2)
    monkeypatch.setattr(model_upgrade, "IDLE_S", 0.2)
    monkeypatch.setattr(selector, "host_timer", _scripted("others", 1.0))
    engine = _engine()
    runner = engine.executor.runner
    runner._upgrades.pending.future.result(timeout=300)
    monkeypatch.setattr(selector, "host_timer", _scripted(retime_slower, 1.0))
    _greedy(engine, list(range(5, 25)), 3)
    assert runner._upgrades.retiming
    return engine, runner


def test_noisy_plans_timed_again_to_the_same_choices_stand(monkeypatch, tmp_path) -> None:
    """A host that stays noisy: the second timing makes the same choices, so the plans stand
    (confirmed, in this process and in the cache) instead of being timed again and again."""
    engine, runner = _served_on_noisy_plans(monkeypatch, tmp_path)
    first = runner.model
    runner._upgrades.pending.future.result(timeout=300)
    _greedy(engine, list(range(5, 25)), 3)
    assert runner.model is first  # the same choices: nothing swapped
    assert runner._upgrades.pending is None  # and nothing more to time
    cache = selector.PlanCache()
    noisy = [p for p in cache.plans.values() if p.noise > selector.NOISY]
    assert noisy and all(p.confirmed and not p.provisional for p in noisy)
    again = _engine().executor.runner
    assert again._upgrades.pending is None  # the next start trusts them


def test_noisy_plans_timed_again_to_other_choices_stand_too(monkeypatch, tmp_path) -> None:
    """Noisy on both timings and choosing differently (candidates within the noise of each
    other): the second timing's plans are swapped in and stand, with no third timing (which
    would read the whole model again)."""
    engine, runner = _served_on_noisy_plans(monkeypatch, tmp_path, "torch")  # kernels win
    first = runner.model
    runner._upgrades.pending.future.result(timeout=300)
    _greedy(engine, list(range(5, 25)), 3)
    assert runner.model is not first  # other choices: swapped in
    assert selector.KERNELS in runner.cpu.plans.plans["rms_norm"].used()
    assert runner._upgrades.pending is None  # and nothing more to time
    noisy = [p for p in selector.PlanCache().plans.values() if p.noise > selector.NOISY]
    assert noisy and all(p.confirmed and not p.provisional for p in noisy)


def test_a_plans_upgrade_reads_after_the_first_model_and_borrows_from_it(monkeypatch,
                                                                         tmp_path):
    """On an empty plan cache the timed model is read once the untimed one is (two reads at
    once would peak at both), and its load is handed the model that serves meanwhile (whose
    int8 embedding and head it takes, ``LoadOptions.reuse``)."""
    monkeypatch.setattr(selector, "_mode", "auto")
    monkeypatch.setenv(selector.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(model_upgrade, "needs_background_build", lambda: False)
    calls = []

    def load(timed, cache, serving):
        calls.append(("start", timed, serving))
        if not timed:
            time.sleep(0.2)  # an upgrade started beside this read would start in between
        calls.append(("end", timed))
        return f"model timed={timed}"

    upgrades = model_upgrade.CpuUpgrades(load, lambda model: None, "sig", lambda: 0.0)
    assert upgrades.start() == "model timed=False"
    assert upgrades.pending.future.result(timeout=30) == "model timed=True"
    assert calls == [("start", False, None), ("end", False),
                     ("start", True, "model timed=False"), ("end", True)]
