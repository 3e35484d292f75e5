"""Whether a step speculates, decided by measurement (docs/speculative-decoding.md).

A step either speculates (proposals made and verified) or is a *plain* step, run exactly as
without a speculative config. With async scheduling a plain step is an async one: launched
while the step before it is still on the device. A step with proposals cannot run that way (its
proposals follow each request's newest tokens), so speculating also gives up the overlap. With
async scheduling off a plain step keeps the one-call decode step (or CUDA graphs) and skips the
proposers and the draft model. Either way speculating pays only where the accepted proposals
are worth more than what it costs, and the engine asks before each step:
- the seconds of plain steps and of speculating steps (each in a run of its own mode), each
  fitted against the step's requests as ``StepCost`` fits rows, both over pure decode steps
  only;
- the tokens a speculating step yields per request (accepted proposals and one more), a
  decayed mean; a plain step yields one. Acceptance comes in stretches (text the proposer
  knows, then text it does not), so the mean follows it closely while speculating; while plain
  steps run it drifts back to its long-run value (a slower mean), so the dip that turned
  speculation off does not decide every step until the next probe;
- a step of ``n`` requests speculates when ``yield * T_plain(n) > T_spec(n)``.
Every measured step, of either mode, weighs both modes' past down, so the mode not chosen is
judged by its latest probe rather than by runs long gone (the ratios hold between probes).
The mode not chosen is probed for ``PROBE_STEPS`` steps now and then: the gap between probes
doubles while they confirm the choice (up to ``MAX_GAP`` steps) and starts again at
``MIN_GAP`` when the choice flips, so a change of workload is seen and followed.
``forced`` pins the answer (tests that check speculation itself).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tidal.core.request import Request
from tidal.core.scheduler_output import SchedulerOutput
from tidal.core.spec_policy import StepCost

PROBE_STEPS = 3  # a probe's first step follows the other mode: it is not measured
MIN_GAP = 16  # steps of the chosen mode before the other is probed, after a flip
MAX_GAP = 256  # the longest gap between probes
FIT_DECAY = 0.9  # per step of either mode: a probe's steps, not old runs, must decide
OUTLIER = 2.0  # a step counts at most this times its prediction (a stall, a first shape)
YIELD_DECAY = 0.8  # per measured step of either mode, in the tokens-per-request mean
LONG_RUN_DECAY = 0.98  # per speculating step, in the long-run mean it drifts back to


@dataclass
class StepModes:
    """The per-step choice between a plain step and a speculating one."""

    plain_cost: StepCost = field(default_factory=lambda: StepCost(FIT_DECAY))
    spec_cost: StepCost = field(default_factory=lambda: StepCost(FIT_DECAY))
    speculating: bool = False  # the mode judged faster
    forced: bool | None = None  # set: every step's answer, nothing measured decides
    _yield_sums: list[float] = field(default_factory=lambda: [0.0, 0.0])  # tokens, requests
    _long_run_sums: list[float] = field(default_factory=lambda: [0.0, 0.0])
    _probe_left: int = 0  # steps left of the probe running
    _until_probe: int = PROBE_STEPS  # steps of the chosen mode before the next probe
    _gap: int = MIN_GAP // 2
    _last: bool = False  # whether the step observed last speculated

    @property
    def spec_yield(self) -> float | None:
        """Tokens per request of a speculating step, or None before one is seen."""
        tokens, requests = self._yield_sums
        return tokens / requests if requests else None

    def choose(self, running: Sequence[Request]) -> bool:
        """Whether the next step speculates. Never while no request is decoding (a request
        whose first token is in flight counts), nor in a step that cannot be measured."""
        if self.forced is not None:
            return self.forced
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
        """Whether speculating beats plain steps at ``num_requests`` (None: not measured)."""
        t_plain = self.plain_cost.predict(num_requests)
        t_spec = self.spec_cost.predict(num_requests)
        gain = self.spec_yield
        if t_plain is None or t_spec is None or gain is None:
            return None
        return gain * t_plain > t_spec

    def observe_step(self, sched: SchedulerOutput, speculated: bool, seconds: float,
                     num_accepted: int, runs_only: bool) -> None:
        """A processed step of either mode took ``seconds`` from its start; with
        ``runs_only`` (async scheduling off) it counts only after a step of its own mode: the
        first step of a run pays for the switch (a draft model catching up, with no proposals
        of its own yet)."""
        after_same, self._last = speculated == self._last, speculated
        if runs_only and not after_same:
            return
        if speculated:
            self.observe_spec(sched, seconds, num_accepted)
        else:
            self.observe_plain(sched, seconds)

    def observe_plain(self, sched: SchedulerOutput, seconds: float) -> None:
        """A plain step that followed another took ``seconds``, start to end."""
        n = len(sched.num_scheduled_tokens)
        if sched.total_num_scheduled_tokens == n > 0:
            _observe(self.plain_cost, n, seconds)
            self.spec_cost.fade()
            tokens, requests = self._long_run_sums
            long_run = tokens / requests if requests else None
            sums = self._yield_sums
            if long_run is None:
                self._yield_sums = [YIELD_DECAY * x for x in sums]
            else:  # the long-run mean weighs in as a speculating step of n requests would
                self._yield_sums = [YIELD_DECAY * sums[0] + n * long_run,
                                    YIELD_DECAY * sums[1] + n]

    def observe_spec(self, sched: SchedulerOutput, seconds: float, num_accepted: int) -> None:
        """A speculating step took ``seconds`` and its targets accepted ``num_accepted`` of
        its proposals."""
        n = len(sched.num_scheduled_tokens)
        drafts = sched.scheduled_spec_decode_tokens
        if not n or sched.total_num_scheduled_tokens != n + sum(map(len, drafts.values())):
            return  # a prefill chunk in it: not a decode step
        _observe(self.spec_cost, n, seconds)
        self.plain_cost.fade()
        for sums, decay in ((self._yield_sums, YIELD_DECAY),
                            (self._long_run_sums, LONG_RUN_DECAY)):
            sums[0] = decay * sums[0] + n + num_accepted
            sums[1] = decay * sums[1] + n


def _observe(cost: StepCost, rows: int, seconds: float) -> None:
    """A step's time into ``cost``, an outlier (the host stalled, a shape's first run) cut to
    ``OUTLIER`` times the prediction, so one bad step does not decide many."""
    predicted = cost.predict(rows)
    cost.observe(rows, seconds if predicted is None else min(seconds, OUTLIER * predicted))
