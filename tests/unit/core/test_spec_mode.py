"""The per-step choice between an async step and a speculating one (``core/spec_mode.py``),
fed simulated step times: it speculates where the accepted proposals beat async scheduling's
overlap, stops where they do not, and follows a change of workload by its probes."""

from __future__ import annotations

from tidal.core.request import Request
from tidal.core.sampling_params import SamplingParams
from tidal.core.scheduler_output import SchedulerOutput
from tidal.core.spec_mode import MAX_GAP, StepModes


def _decoding(n: int) -> list[Request]:
    requests = []
    for i in range(n):
        request = Request(f"r{i}", [1, 2, 3], SamplingParams())
        request.append_output_token(4)
        requests.append(request)
    return requests


def _step(modes: StepModes, running: list[Request], t_async: float, t_spec: float,
          accepted_per_request: float) -> bool:
    """One step of ``len(running)`` decodes: the chooser's answer, and the step's simulated
    seconds reported back (a speculating step proposes two tokens a request)."""
    speculate = modes.choose(running)
    n = len(running)
    if speculate:
        sched = SchedulerOutput([], {}, {r.request_id: 3 for r in running}, 3 * n,
                                scheduled_spec_decode_tokens={r.request_id: [5, 6]
                                                              for r in running})
        modes.observe_spec(sched, t_spec, round(accepted_per_request * n))
    else:
        sched = SchedulerOutput([], {}, {r.request_id: 1 for r in running}, n)
        modes.observe_plain(sched, t_async)
    return speculate


def _run(modes: StepModes, steps: int, n: int, t_async: float, t_spec: float,
         accepted: float) -> list[bool]:
    running = _decoding(n)
    return [_step(modes, running, t_async, t_spec, accepted) for _ in range(steps)]


def test_speculates_where_the_accepted_proposals_beat_the_overlap():
    modes = StepModes()
    # a copy workload: 1.5 tokens accepted a step, for a step 1.3x an async one
    chosen = _run(modes, 600, 1, 0.010, 0.013, 1.5)
    assert modes.pays(1) is True and modes.speculating
    assert sum(chosen[100:]) / 500 > 0.95  # the rest: probes of async steps now and then
    assert not all(chosen[100:])


def test_keeps_async_steps_where_speculating_does_not_pay():
    modes = StepModes()
    # a full batch: proposals mostly rejected, and a speculating step loses the overlap
    chosen = _run(modes, 600, 32, 0.020, 0.035, 0.3)
    assert modes.pays(32) is False and not modes.speculating
    assert sum(chosen[100:]) <= 500 * 3 / 64  # probes only, ever further apart


def test_follows_a_change_of_workload():
    modes = StepModes()
    _run(modes, 400, 32, 0.020, 0.035, 0.3)
    assert not modes.speculating
    # the same batch now copies its prompt: found by the next probes
    chosen = _run(modes, 3 * MAX_GAP, 32, 0.020, 0.030, 3.0)
    assert modes.speculating
    assert sum(chosen[-MAX_GAP:]) > 0.9 * MAX_GAP
    # and back
    _run(modes, 3 * MAX_GAP, 32, 0.020, 0.035, 0.3)
    assert not modes.speculating


def test_never_speculates_before_a_request_decodes():
    modes = StepModes()
    prefilling = [Request("p", [1, 2, 3], SamplingParams())]
    assert not any(modes.choose(prefilling) for _ in range(50))


def test_one_stalled_step_does_not_decide():
    modes = StepModes()
    _run(modes, 300, 1, 0.010, 0.013, 1.5)
    assert modes.speculating
    running = _decoding(1)
    modes.observe_spec(SchedulerOutput([], {}, {"r0": 3}, 3, scheduled_spec_decode_tokens={
        "r0": [5, 6]}), 1.0, 2)  # the host stalled for a second
    assert modes.pays(1) and modes.choose(running)


def test_with_async_scheduling_off_the_first_step_of_a_run_is_not_measured():
    """It pays for the switch (a draft model catching up, its proposals not made yet)."""
    modes = StepModes()
    ids = [r.request_id for r in _decoding(2)]
    plain = SchedulerOutput([], {}, dict.fromkeys(ids, 1), 2)
    spec = SchedulerOutput([], {}, dict.fromkeys(ids, 3), 6,
                           scheduled_spec_decode_tokens=dict.fromkeys(ids, [5, 6]))
    modes.observe_step(spec, True, 5.0, 0, runs_only=True)
    assert modes.spec_cost.predict(2) is None and modes.spec_yield is None
    modes.observe_step(spec, True, 0.015, 2, runs_only=True)
    assert modes.spec_cost.predict(2) == 0.015 and modes.spec_yield == 2.0
    modes.observe_step(plain, False, 5.0, 0, runs_only=True)
    assert modes.plain_cost.predict(2) is None
    modes.observe_step(plain, False, 0.01, 0, runs_only=True)
    assert modes.plain_cost.predict(2) == 0.01 and modes.pays(2) is True


def test_a_dip_in_acceptance_turns_speculation_off_only_for_a_few_steps():
    """Acceptance comes in stretches: after a few rejected steps the plain steps bring the
    yield back to its long-run mean, and speculation resumes well before the next probe."""
    modes = StepModes()
    _run(modes, 200, 1, 0.010, 0.020, 1.8)  # pays on average: 2.8 tokens for 2x a step
    assert modes.speculating
    chosen = _run(modes, 6, 1, 0.010, 0.020, 0.0)  # a stretch the proposer does not know
    assert not all(chosen)
    after = _run(modes, 12, 1, 0.010, 0.020, 1.8)
    assert sum(after) >= 10
