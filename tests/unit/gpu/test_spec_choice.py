"""The engine's per-step choice with async scheduling off (``core/spec_mode.py``), on scripted
step times: a clock that only the steps move, by a fixed cost for a plain step and another for
a speculating one. Where a speculating step costs more than its accepted proposals give the
engine runs plain steps (probes aside), and where it pays it speculates again."""

from __future__ import annotations

import types

import pytest

from tests.device import on_test_device
from tests.unit.gpu.test_spec_decode import (  # noqa: F401 - a fixture
    SPEC,
    _completions,
    _prompts,
    echo_model,
)
from tidal.core import LLM, SamplingParams, engine_core


class ScriptedSteps:
    """The engine's clock, moved by each launched step: ``costs[speculating]`` seconds."""

    def __init__(self, llm: LLM) -> None:
        self.now = 0.0
        self.costs = {False: 0.010, True: 0.010}
        self.modes: list[bool] = []  # each decode step's mode, in order
        engine = llm.engine
        speculator = engine.scheduler.speculator
        launch = engine.executor.execute_model_async

        def execute(sched, before_forward=None):
            if not sched.is_empty:
                self.now += self.costs[speculator.active]
                self.modes.append(speculator.active)
            return launch(sched, before_forward)

        engine.executor.execute_model_async = execute

    def perf_counter(self) -> float:
        return self.now


@pytest.mark.gpu
def test_speculation_turns_off_where_it_costs_more_and_back_on_where_it_pays(
        echo_model, monkeypatch):  # noqa: F811
    args = on_test_device(dtype="float32", max_num_seqs=4, async_scheduling=False)
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    want = _completions(LLM(echo_model, **args).generate(_prompts(), params, use_tqdm=False))
    llm = LLM(echo_model, speculative_config=SPEC, **args)
    llm.engine.scheduler.speculator.policy.keep = lambda _req_id, n, _rows: n
    steps = ScriptedSteps(llm)
    monkeypatch.setattr(engine_core, "time", types.SimpleNamespace(
        perf_counter=steps.perf_counter, monotonic=steps.perf_counter))
    # a speculating step costs six plain ones: not even k = 4 accepted proposals pay
    steps.costs = {False: 0.010, True: 0.060}
    assert _completions(llm.generate(_prompts(), params, use_tqdm=False)) == want
    costly = steps.modes[20:]
    assert sum(costly) <= 0.15 * len(costly)  # probes only
    assert not llm.engine.spec_modes.speculating
    # now a speculating step is the cheaper: it pays with or without accepted proposals
    steps.costs = {False: 0.010, True: 0.006}
    assert _completions(llm.generate(_prompts(), params, use_tqdm=False)) == want
    assert llm.engine.spec_modes.speculating  # found by a probe
    steps.modes = []
    assert _completions(llm.generate(_prompts(), params, use_tqdm=False)) == want
    assert sum(steps.modes) >= 0.8 * len(steps.modes)  # a prefill step and probes aside
    assert llm.engine.stats().spec_decode_num_accepted_tokens > 0
