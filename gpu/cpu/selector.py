"""Which implementation runs each CPU op, chosen by timing every candidate on this host.

A kernel that wins on one CPU can lose many times over on another (a GEMM tiled for AVX-512's
32 vector registers spills on AVX2's 16), so nothing here assumes a winner. For each op and
shape the model will run, and for each row count the scheduler can produce (decode batches
and prefill chunks, in power-of-two buckets), every candidate is timed with random inputs of
that shape: tidal's kernels, oneDNN's and MKL's packed GEMMs, and torch's own ops, which are
always among them. The fastest per bucket makes a ``Plan``. Plans are cached on disk per
machine, keyed by the CPU's model and flags, torch's version, the kernels' build and the
thread count, so later starts skip the timing.

``TIDAL_CPU_KERNELS`` (or ``--cpu-kernels``): ``auto`` (measure, the default), ``force``
(tidal's kernels wherever they apply, no timing) or ``off`` (no kernels of tidal's are built;
linears still choose between torch's own oneDNN and plain paths).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from tidal.gpu.cpu.host import cpu_flags, cpu_model

logger = logging.getLogger(__name__)

MODE_ENV = "TIDAL_CPU_KERNELS"
MODES = ("auto", "force", "off")
CACHE_ENV = "TIDAL_CACHE_DIR"  # where plans are kept (default ~/.cache/tidal)
TORCH = "torch"  # the name of torch's own path among an op's candidates
KERNELS = "tidal"  # the name of tidal's compiled kernel, for ops other than the linears
# Each candidate is called until it has run this long in a bucket (and at least MIN_CALLS
# times, at most MAX_CALLS); its best call counts, as a co-tenant can slow any one call.
TARGET_MS_PER_CANDIDATE = 15.0
MIN_CALLS, MAX_CALLS = 3, 25
# A candidate within this fraction of a bucket's best counts as as fast (timing noise).
TIE_MARGIN = 0.05
PASSES = 2  # sweeps over the buckets, a candidate's best over all of them counting
# A candidate this many times slower than a bucket's best after one round cannot win there
# by any noise: it is timed no further in that bucket (nor in later passes).
HOPELESS = 4.0
# Bumped when how plans are chosen changes, so plans cached by the older rule are timed again.
SELECTOR_VERSION = "3"
# Timings noisier than this (``timing_noise``) make a plan provisional: timed again later.
NOISY = 0.15

# (candidate's name, its call, how many calls) -> the best call's ms. Tests give their own.
Timer = Callable[[str, Callable[[], object], int], float]


_mode: str | None = None  # set_mode's choice, over the environment's


def set_mode(value: str | None) -> None:
    """Choose the mode for this process (``None``: the environment's again)."""
    global _mode
    if value is not None and value not in MODES:
        raise ValueError(f"cpu_kernels must be one of {', '.join(MODES)}; got {value!r}")
    _mode = value


def mode() -> str:
    """``auto``, ``force`` or ``off``: ``set_mode``'s, else ``TIDAL_CPU_KERNELS``'s
    (``TIDAL_NO_CPU_KERNELS=1`` is ``off`` too), else ``auto``."""
    if _mode is not None:
        return _mode
    if os.environ.get("TIDAL_NO_CPU_KERNELS") == "1":  # the older switch
        return "off"
    value = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{MODE_ENV} must be one of {', '.join(MODES)}; got {value!r}")
    return value


def row_buckets(max_rows: int) -> list[int]:
    """Powers of two up to ``max_rows``, and ``max_rows`` itself: the row counts timed."""
    buckets = [1]
    while buckets[-1] * 2 < max_rows:
        buckets.append(buckets[-1] * 2)
    if max_rows > buckets[-1]:
        buckets.append(max_rows)
    return buckets


@dataclass(frozen=True)
class Plan:
    """Which candidate runs an op: ``choices[i]`` for row counts up to ``bounds[i]``, the
    last choice past the last bound. ``timings`` (ms, per bound and candidate) say why."""

    bounds: tuple[int, ...]
    choices: tuple[str, ...]
    timings: tuple[dict[str, float], ...] = ()
    noise: float = 0.0  # timing_noise while it was timed
    load: float | None = None  # the host's load per core when it was timed
    made_at: float = 0.0  # when (seconds since the epoch); 0 for a plan not timed
    confirmed: bool = False  # noisy, but timed a second time (``PlanCache.confirm``): it stands
    _table: tuple[str, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        table: list[str] = []
        for bound, choice in zip(self.bounds, self.choices):
            table += [choice] * (bound + 1 - len(table))
        object.__setattr__(self, "_table", tuple(table))

    @classmethod
    def always(cls, choice: str) -> Plan:
        return cls((1,), (choice,))

    def pick(self, rows: int) -> str:
        table = self._table
        return table[rows] if rows < len(table) else table[-1]

    def by_rows(self) -> list[str]:
        """The choice for 0, 1, ... rows up to the last bound (then the last holds)."""
        return list(self._table)

    def used(self) -> set[str]:
        return set(self.choices)

    def describe(self) -> str:
        """e.g. ``onednn 1-8 rows, panels 9-64, mkl 65+``."""
        spans, start = [], 1
        for i, choice in enumerate(self.choices):
            last = i == len(self.choices) - 1
            if not last and self.choices[i + 1] == choice:
                continue
            end = "+" if last else f"-{self.bounds[i]}"
            spans.append(f"{choice} {start}{end}" if end != f"-{start}" else f"{choice} {start}")
            start = self.bounds[i] + 1
        return ", ".join(spans) + " rows"

    def single(self) -> str:
        """The one candidate that loses least over every bucket (sum of time over the best),
        for where only one layout of a weight can be kept."""
        if not self.timings:
            return self.choices[-1]
        names = set.intersection(*(set(t) for t in self.timings))
        return min(sorted(names), key=lambda n: sum(t[n] / min(t.values())
                                                    for t in self.timings))

    @property
    def provisional(self) -> bool:
        """Timed while the host was too noisy to trust: to be timed again when quiet
        (unless it was timed a second time: ``PlanCache.confirm``)."""
        return self.noise > NOISY and not self.confirmed

    def covers(self, buckets: list[int]) -> bool:
        """Whether this plan was timed at every one of ``buckets`` (``row_buckets``), its last
        (a step's largest row count, not always a power of two) at or past it: a plan timed
        for a larger step serves a smaller one, so engines of different sizes on one model
        share their plans instead of each timing them again over the other's."""
        return set(buckets[:-1]) <= set(self.bounds) and self.bounds[-1] >= buckets[-1]

    def same_choices(self, other: Plan) -> bool:
        return (self.bounds, self.choices) == (other.bounds, other.choices)

    def to_json(self) -> dict:
        return {"bounds": list(self.bounds), "choices": list(self.choices),
                "timings": list(self.timings), "noise": self.noise, "load": self.load,
                "made_at": self.made_at, "confirmed": self.confirmed}

    @classmethod
    def from_json(cls, data: dict) -> Plan:
        return cls(tuple(data["bounds"]), tuple(data["choices"]),
                   tuple(data.get("timings", ())), float(data.get("noise", 0.0)),
                   data.get("load"), float(data.get("made_at", 0.0)),
                   bool(data.get("confirmed", False)))


def best_ms(fn: Callable[[], object], calls: int) -> float:
    """The fastest of ``calls`` calls, in ms."""
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def host_timer(name: str, fn: Callable[[], object], calls: int) -> float:
    return best_ms(fn, calls)


@dataclass
class Timed:
    """One bucket's timings: each round's time per candidate (a round: ``MIN_CALLS`` calls,
    its best counting), rounds alternating between the candidates; ``dropped``: those left
    after their first round, ``HOPELESS`` times slower than the best."""

    rounds: dict[str, list[float]]
    dropped: frozenset[str] = frozenset()

    def best(self) -> dict[str, float]:
        return {name: min(times) for name, times in self.rounds.items()}

    def merge(self, other: Timed) -> Timed:
        return Timed({name: times + other.rounds.get(name, [])
                      for name, times in self.rounds.items()}, self.dropped | other.dropped)


def time_candidates(fns: dict[str, Callable[[], object]], timer: Timer = host_timer) -> Timed:
    """Each candidate's rounds, ms. Candidates are called in turns, a few calls each, so a
    burst of load on the host falls on all of them rather than on one. One far behind the
    best after the first round is dropped: its remaining rounds would only cost time (a
    dequantizing path can take seconds a call where the best takes milliseconds)."""
    first = {name: timer(name, fn, 1) for name, fn in fns.items()}  # warms caches and packs too
    rounds = {name: [timer(name, fn, MIN_CALLS)] for name, fn in fns.items()}
    best = min(times[0] for times in rounds.values())
    dropped = frozenset(name for name, times in rounds.items() if times[0] > HOPELESS * best)
    live = {name: fn for name, fn in fns.items() if name not in dropped}
    slowest = max(max(first[name] for name in live), 1e-3)
    calls = int(min(MAX_CALLS, max(MIN_CALLS, TARGET_MS_PER_CANDIDATE / slowest)))
    for _ in range(max(2, calls // MIN_CALLS) - 1):
        for name, fn in live.items():
            rounds[name].append(timer(name, fn, MIN_CALLS))
    return Timed(rounds, dropped)


def timing_noise(timed: Iterable[Timed]) -> float:
    """How much the host disturbed the timings: the median, over every bucket's candidates,
    of the spread of a candidate's rounds (slowest over fastest, less one). A quiet host
    repeats a call within a few percent; a co-tenant makes rounds differ by tens."""
    spreads = sorted(max(times) / max(min(times), 1e-9) - 1.0
                     for t in timed for times in t.rounds.values() if len(times) > 1)
    return spreads[len(spreads) // 2] if spreads else 0.0


def host_load() -> float:
    """The 1-minute load average per core (what else the host was running, and this
    process itself)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 0.0


def choose(buckets: Iterable[int], candidates: Callable[[int], dict[str, Callable[[], object]]],
           timer: Timer = host_timer) -> Plan:
    """Time ``candidates(rows)`` at every bucket (``PASSES`` sweeps, a candidate's best over
    all its rounds counting) and keep the fewest candidates that come within the margin of
    every bucket's best (``fewest_within``), then per bucket the fastest of them, holding to
    the previous bucket's choice unless it loses by more than the margin
    (``steady_choices``). The margin is ``TIE_MARGIN`` or the timings' noise, if more: a win
    inside the noise is no win, so a noisy host gets one layout per op, not a patchwork."""
    bounds = list(buckets)
    timed = [time_candidates(candidates(rows), timer) for rows in bounds]
    for _ in range(PASSES - 1):  # a burst of load on the host now spoils one pass, not all
        timed = [t.merge(time_candidates(_without(candidates(rows), t.dropped), timer))
                 for t, rows in zip(timed, bounds)]
    timings = [t.best() for t in timed]
    noise = timing_noise(timed)
    margin = max(TIE_MARGIN, noise)
    choices = steady_choices(timings, fewest_within(timings, margin), margin)
    return Plan(tuple(bounds), tuple(choices),
                tuple({name: round(ms, 4) for name, ms in t.items()} for t in timings),
                noise=round(noise, 4), load=round(host_load(), 2), made_at=round(time.time()))


def _without(fns: dict[str, Callable[[], object]], dropped: frozenset[str]
             ) -> dict[str, Callable[[], object]]:
    return {name: fn for name, fn in fns.items() if name not in dropped}


def steady_choices(timings: list[dict[str, float]], kept: set[str], margin: float
                   ) -> list[str]:
    """Per bucket, the fastest of ``kept``, unless the previous bucket's choice is within
    ``margin`` of it: neighbouring buckets flip only on a win larger than the margin."""
    choices: list[str] = []
    for t in timings:
        best = min(kept & set(t), key=t.__getitem__)
        if choices and choices[-1] in t and t[choices[-1]] <= (1 + margin) * t[best]:
            best = choices[-1]
        choices.append(best)
    return choices


def fewest_within(timings: list[dict[str, float]], margin: float) -> set[str]:
    """The smallest set of candidates that has, for every bucket, one within ``margin`` of that
    bucket's best (ties: the set losing least summed over the buckets). Every candidate a plan
    uses is another packed copy of a weight, so a win inside the timings' noise is not worth
    one."""
    names = sorted(set.intersection(*(set(t) for t in timings)))

    def loss(kept: tuple[str, ...]) -> float:
        return sum(min(t[n] for n in kept) / min(t.values()) for t in timings)

    for size in range(1, len(names) + 1):
        fits = [kept for kept in itertools.combinations(names, size)
                if all(min(t[n] for n in kept) <= (1 + margin) * min(t.values())
                       for t in timings)]
        if fits:
            return set(min(fits, key=loss))
    return set(names)


def host_key() -> dict[str, str]:
    """What makes a plan valid: this CPU, torch's build, the kernels' build, the threads."""
    from tidal.gpu.cpu.kernels import build_name

    return {"selector": SELECTOR_VERSION, "cpu": cpu_model(),
            "flags": " ".join(sorted(cpu_flags())),
            "torch": torch.__version__, "kernels": build_name() if mode() != "off" else "off",
            "threads": str(torch.get_num_threads())}


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tidal")


class PlanCache:
    """Plans by key (op and shape), in one JSON file per host key."""

    def __init__(self, directory: Path | None = None, key: dict[str, str] | None = None,
                 timer: Timer | None = None) -> None:
        self.key = key if key is not None else host_key()
        self.timer = timer if timer is not None else host_timer
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:16]
        self.path = (directory or cache_dir()) / f"cpu_plans-{digest}.json"
        self.plans: dict[str, Plan] = {}
        # the models (their shapes and settings, ``ModelRunner.plan_signature``) planned whole
        self.models: dict[str, dict] = {}
        self.measured: list[str] = []  # keys timed in this process, not read from the file
        self._changed = False
        try:
            data = json.loads(self.path.read_text())
            if data.get("host") == self.key:  # a file from another host is never read
                self.plans = {k: Plan.from_json(v) for k, v in data["plans"].items()}
                self.models = dict(data.get("models", {}))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass

    def knows_model(self, signature: str) -> bool:
        """Whether every plan of the model ``signature`` names was timed here before."""
        return signature in self.models

    def record_model(self, signature: str, plans: list[Plan]) -> None:
        self.models[signature] = {"made_at": round(time.time()),
                                  "provisional": any(p.provisional for p in plans)}
        self._changed = True

    def forget(self, plans: list[Plan]) -> list[str]:
        """Drop the plans equal to any of ``plans``, so they are timed again; their keys."""
        dropped = [k for k, plan in self.plans.items()
                   if replace(plan, confirmed=False) in plans or plan in plans]
        for key in dropped:
            del self.plans[key]
        return dropped

    def forget_provisional(self) -> dict[str, Plan]:
        """Drop the plans timed on a noisy host, so they are timed again; them, by key."""
        dropped = {k: plan for k, plan in self.plans.items() if plan.provisional}
        for key in dropped:
            del self.plans[key]
        return dropped

    def confirm(self, before: dict[str, Plan]) -> list[Plan]:
        """``before``'s plans, timed again: marked confirmed (no longer provisional) here,
        whatever they chose; the plans as they were timed again. A plan noisy once is timed
        once more, on an idle engine after a wait; if that timing is noisy too, the noise is
        the op's own (a call of a few microseconds differs from round to round by more than
        ``NOISY`` on a quiet host), its candidates are within it of each other, and a third
        timing, which re-reads the whole model, would not choose better."""
        again = [k for k in before if k in self.plans]
        timed_again = [self.plans[k] for k in again]
        for key in again:
            self.plans[key] = replace(self.plans[key], confirmed=True)
        self._changed = self._changed or bool(again)
        return timed_again

    def get_or_choose(self, key: str, buckets: list[int],
                      candidates: Callable[[int], dict[str, Callable[[], object]]]) -> Plan:
        plan = self.plans.get(key)
        if plan is None or not plan.covers(buckets):
            plan = choose(buckets, candidates, self.timer)
            self.plans[key] = plan
            self.measured.append(key)
        return plan

    def save(self) -> None:
        if not self.measured and not self._changed:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
            tmp.write_text(json.dumps({"host": self.key, "plans": {
                k: p.to_json() for k, p in sorted(self.plans.items())},
                "models": self.models}, indent=1))
            tmp.replace(self.path)
        except OSError as exc:
            logger.warning("could not save the CPU kernel plans to %s: %s", self.path, exc)
