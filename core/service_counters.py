"""Which clients take part in a step when several have work: virtual token counters.

On a device where a step's time grows with its rows (a CPU above all), one client's 63 decode
rows make every step slow for the client beside it with one row: a slot of its own in the
batch is not enough. Each client with work has a counter of the tokens the engine has computed
for it; a step takes the client furthest behind, and every other client whose counter plus the
rows it would add stays within ``burst`` tokens of that one. The client with one row then runs
in steps of its own until it has had as many tokens as the client with 63 rows, instead of in
steps 63 rows wide. Over time each client with work gets the same number of tokens, whatever
number of sequences it sends (the virtual token counter of Sheng et al., "Fairness in Serving
Large Language Models", OSDI 2024, applied to the step's rows as well as to admission).

A client that starts having work again begins far enough behind the least-served client with
work that its first ``burst`` tokens run in steps of their own: it cannot bank more credit than
that while idle, and a short interactive request runs ahead of a flood. With one client (the
offline API, a benchmark) nothing is held back.
"""

from __future__ import annotations

from collections.abc import Callable


class ServiceCounters:
    def __init__(self, burst: int) -> None:
        self.burst = burst
        self._served: dict[str, int] = {}  # the clients with work, and their tokens

    def step_filter(self, demand: dict[str, int]) -> Callable[[str], bool] | None:
        """Whether each client may run this step, given the rows each client with work would
        add (``demand``); None when every client may (one client, or none)."""
        served = self._served
        for gone in [c for c in served if c not in demand]:
            del served[gone]
        # far enough behind that the others sit out its first ``burst`` tokens
        start = min(served.values()) - self.burst - max(demand.values(), default=0) if served else 0
        for client in demand:
            if client not in served:
                served[client] = start
        if len(demand) <= 1:
            return None
        low = min(served[c] for c in demand)
        allowed = {c for c in demand
                   if served[c] == low or served[c] + demand[c] - low <= self.burst}
        if len(allowed) == len(demand):
            return _everyone
        return allowed.__contains__

    def charge(self, client: str, tokens: int) -> None:
        """Count ``tokens`` computed for ``client`` by this step (while several have work)."""
        if client in self._served:
            self._served[client] += tokens

    @property
    def spread(self) -> int:
        """Tokens between the most- and the least-served client with work (0 with one)."""
        values = self._served.values()
        return max(values) - min(values) if values else 0


def _everyone(_client: str) -> bool:
    return True
