"""Whether a step speculates, with async scheduling on (docs/speculative-decoding.md).

An async step is launched while the step before it is still on the device, so the device does
not wait for the host's bookkeeping. A step with proposals cannot run that way: its proposals
follow each request's newest tokens, so the step in flight is processed first, and the step
after it cannot be planned before its proposals are verified, so it is processed at once.
Speculating gives up the overlap for that step; it pays only where the accepted proposals
are worth more. The engine asks before each step, and the answer is measured:
- the seconds of async steps (step start to step end, in a run of them: the period) and of
  speculating steps (after the step in flight is processed), each fitted against the step's
  requests as ``StepCost`` fits rows, both over pure decode steps only;
- the tokens a speculating step yields per request (accepted proposals and one more), a
  decayed mean; an async step yields one;
- a step of ``n`` requests speculates when ``yield * T_async(n) > T_spec(n)``.
The mode not chosen is probed for ``PROBE_STEPS`` steps now and then: the gap between probes
doubles while they confirm the choice (up to ``MAX_GAP`` steps) and starts again at
``MIN_GAP`` when the choice flips, so a change of workload is seen and followed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tidal.core.request import Request
from tidal.core.scheduler_output import SchedulerOutput
from tidal.core.spec_policy import StepCost

PROBE_STEPS = 3  # an async probe's first step has no step in flight: it is not measured
MIN_GAP = 16  # steps of the chosen mode before the other is probed, after a flip
MAX_GAP = 256  # the longest gap between probes
FIT_DECAY = 0.9  # per observation: few probe steps must move the fit
OUTLIER = 2.0  # a step counts at most this times its prediction (a stall, a first shape)
YIELD_DECAY = 0.8  # per speculating step, in the tokens-per-request mean


@dataclass
class StepModes:
    """The per-step choice between an async step and a speculating one."""

    async_cost: StepCost = field(default_factory=lambda: StepCost(FIT_DECAY))
    spec_cost: StepCost = field(default_factory=lambda: StepCost(FIT_DECAY))
    speculating: bool = False  # the mode judged faster
    _yield_sums: list[float] = field(default_factory=lambda: [0.0, 0.0])  # tokens, requests
    _probe_left: int = 0  # steps left of the probe running
    _until_probe: int = PROBE_STEPS  # steps of the chosen mode before the next probe
    _gap: int = MIN_GAP // 2

    @property
    def spec_yield(self) -> float | None:
        """Tokens per request of a speculating step, or None before one is seen."""
        tokens, requests = self._yield_sums
        return tokens / requests if requests else None

    def choose(self, running: Sequence[Request]) -> bool:
        """Whether the next step speculates. Never while no request is decoding (a request
        whose first token is in flight counts), nor in a step that cannot be measured."""
        if not any(r.num_output_tokens or r.num_output_placeholders for r in running):
            return False
        if self._probe_left:
            self._probe_left -= 1
            return not self.speculating
        if self._until_probe <= 0:
            self._gap = min(2 * self._gap, MAX_GAP)
            self._until_probe = self._gap
            self._probe_left = PROBE_STEPS - 1
            return not self.speculating
        self._until_probe -= 1
        pays = self.pays(len(running))
        if pays is not None and pays != self.speculating:
            self.speculating = pays
            self._gap = MIN_GAP
            self._until_probe = MIN_GAP
        return self.speculating

    def pays(self, num_requests: int) -> bool | None:
        """Whether speculating beats async steps at ``num_requests`` (None: not measured)."""
        t_async = self.async_cost.predict(num_requests)
        t_spec = self.spec_cost.predict(num_requests)
        gain = self.spec_yield
        if t_async is None or t_spec is None or gain is None:
            return None
        return gain * t_async > t_spec

    def observe_async(self, sched: SchedulerOutput, seconds: float) -> None:
        """An async step that followed another took ``seconds``, start to end."""
        n = len(sched.num_scheduled_tokens)
        if sched.total_num_scheduled_tokens == n > 0:
            _observe(self.async_cost, n, seconds)

    def observe_spec(self, sched: SchedulerOutput, seconds: float, num_accepted: int) -> None:
        """A speculating step took ``seconds`` and its targets accepted ``num_accepted`` of
        its proposals."""
        n = len(sched.num_scheduled_tokens)
        drafts = sched.scheduled_spec_decode_tokens
        if not n or sched.total_num_scheduled_tokens != n + sum(map(len, drafts.values())):
            return  # a prefill chunk in it: not a decode step
        _observe(self.spec_cost, n, seconds)
        sums = self._yield_sums
        sums[0] = YIELD_DECAY * sums[0] + n + num_accepted
        sums[1] = YIELD_DECAY * sums[1] + n


def _observe(cost: StepCost, rows: int, seconds: float) -> None:
    """A step's time into ``cost``, an outlier (the host stalled, a shape's first run) cut to
    ``OUTLIER`` times the prediction, so one bad step does not decide many."""
    predicted = cost.predict(rows)
    cost.observe(rows, seconds if predicted is None else min(seconds, OUTLIER * predicted))
