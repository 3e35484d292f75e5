"""When speculation pays, decided by measurement (docs/speculative-decoding.md).

A proposal costs a row of the target's forward whether or not it is accepted. With few rows a
step reads the weights once and the extra rows are nearly free; as the batch fills, every row
costs compute, and a proposal that is usually rejected slows everyone. So:
- ``StepCost`` fits the engine's step times against their rows, ``t = a + b * rows``, by
  least squares weighted towards recent steps (a busy moment fades out of the fit);
- each request's acceptance rate ``alpha`` (the share of its proposals accepted, with the
  engine's overall rate as the prior) gives proposal ``i`` an expected ``alpha ** i`` tokens;
- a step of ``n`` rows yields about ``n`` tokens in ``a + b * n`` seconds; proposal ``i`` is
  kept while its ``alpha ** i`` tokens for ``b`` more seconds beat that rate.
Until the fit has seen steps of different sizes, every proposal is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.99  # each step's weight in the fit shrinks by this per later step
PRIOR = 2.0  # pseudo-proposals of the overall rate in each request's estimate


@dataclass
class StepCost:
    """Exponentially weighted least squares of step seconds on rows."""

    decay: float = DECAY
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # w, x, y, xx, xy

    def observe(self, rows: int, seconds: float) -> None:
        self.fade()
        s = self._sums
        s[0] += 1.0
        s[1] += rows
        s[2] += seconds
        s[3] += rows * rows
        s[4] += rows * seconds

    def fade(self) -> None:
        """Weigh the steps seen so far down by ``decay``, as one more step does."""
        s = self._sums
        for i in range(5):
            s[i] *= self.decay

    def fit(self) -> tuple[float, float] | None:
        """``(a, b)``, or None before the rows have varied enough to tell ``b``."""
        w, x, y, xx, xy = self._sums
        if w < 4:
            return None
        var = xx / w - (x / w) ** 2
        if var < 0.25:  # rows all about the same size
            return None
        b = (xy / w - (x / w) * (y / w)) / var
        a = y / w - b * x / w
        return max(a, 0.0), max(b, 0.0)

    def predict(self, rows: int) -> float | None:
        """A step's seconds at ``rows``: the fit's, or while the rows have not varied the
        mean of the steps seen; None before any."""
        fit = self.fit()
        if fit is not None:
            return fit[0] + fit[1] * rows
        w, y = self._sums[0], self._sums[2]
        return y / w if w > 0 else None


@dataclass
class _Acceptance:
    accepted: float = 0.0
    proposed: float = 0.0


class SpecPolicy:
    def __init__(self) -> None:
        self.cost = StepCost()
        self.overall = _Acceptance(1.0, 2.0)  # a prior of one half
        self._requests: dict[str, _Acceptance] = {}

    def alpha(self, req_id: str) -> float:
        """``req_id``'s chance that a proposal is accepted, given the ones before it were."""
        mine = self._requests.get(req_id, _Acceptance())
        prior = self.overall.accepted / self.overall.proposed
        return (mine.accepted + PRIOR * prior) / (mine.proposed + PRIOR)

    def keep(self, req_id: str, num_proposed: int, num_rows: int) -> int:
        """How many of ``num_proposed`` proposals pay in a step of about ``num_rows`` rows."""
        fit = self.cost.fit()
        if fit is None or num_proposed == 0:
            return num_proposed
        a, b = fit
        rows = max(num_rows, 1)
        bar = b * rows / (a + b * rows) if a + b * rows > 0 else 0.0
        alpha, gain, kept = self.alpha(req_id), 1.0, 0
        while kept < num_proposed:
            gain *= alpha
            if gain < bar:
                break
            kept += 1
        return kept

    def settled(self, req_id: str, num_proposed: int, num_accepted: int) -> None:
        """A step verified ``num_proposed`` of ``req_id``'s proposals, accepting the first
        ``num_accepted``. A rejection ends the run: the proposals after it were not tried."""
        tried = min(num_accepted + 1, num_proposed)
        for entry in (self._requests.setdefault(req_id, _Acceptance()), self.overall):
            entry.accepted += num_accepted
            entry.proposed += tried

    def finished(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
