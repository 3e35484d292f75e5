"""A first start that serves at once, and plans that a busy moment does not decide for good.

A better model is prepared on a thread of its own while the current one serves, and swapped in
between two steps (``ModelRunner``). Three things call for one:
- this machine has no build of the CPU kernels yet: they compile first, the model serves on
  torch's paths meanwhile;
- this model's shapes have no plans on this host yet (``PlanCache.knows_model``): it serves on
  untimed defaults while its ops are timed (``op_plans``);
- its plans were timed while the host was noisy (``Plan.provisional``): it serves on them, and
  once the engine has been idle a while they are timed again, with growing waits between
  tries; the model is swapped only where the new plans differ.

A swap reads the model's weights again. What the model it replaces holds already is taken from
it rather than held twice (``LoadOptions.reuse``): a quantized model's int8 embedding and head,
and each quantized linear's and expert's packed layouts that its new plan uses too. The rest (a
float model's linears, layouts the new plans choose afresh) is held twice until the swap.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Generic, TypeVar

from tidal.gpu.cpu import selector
from tidal.gpu.cpu.kernels import build_in_background, is_built
from tidal.gpu.cpu.selector import Plan, PlanCache

if TYPE_CHECKING:
    from tidal.gpu.model_loader import LoadedModel

logger = logging.getLogger(__name__)

Model = TypeVar("Model")  # what the runner loads: its model and what goes with it
# Provisional plans are timed again after this many seconds, then twice as long each try.
RETIME_AFTER_S, RETIME_AT_MOST_S = 30.0, 3600.0
IDLE_S = 10.0  # no step for this long: the engine is idle, a re-time may start


def needs_background_build() -> bool:
    """Whether kernels are wanted here but this machine has no build of them yet."""
    return selector.mode() != "off" and not is_built()


class ModelUpgrade(Generic[Model]):
    """The model ``make_model`` builds on a thread, once ``after`` (if given) is done and its
    result is not None (a kernel build that failed upgrades nothing): ``ready()`` says when
    to swap. ``why`` is what the log says it waits for."""

    def __init__(self, make_model: Callable[[], Model | None], why: str,
                 after: Future | None = None,
                 wait: Callable[[], bool] | None = None) -> None:
        self.make_model = make_model
        self.wait = wait  # blocks until it is time to start; False: never
        self.future: Future = Future()
        logger.info("serving while %s", why)
        if after is None:
            self._start(None)
        else:
            after.add_done_callback(self._start)

    @classmethod
    def for_kernels(cls, make_model: Callable[[], Model | None]) -> ModelUpgrade[Model]:
        return cls(make_model, "tidal's C++ CPU kernels build in the background (once per "
                   "machine), on torch's paths meanwhile", after=build_in_background())

    def _start(self, prerequisite: Future | None) -> None:
        threading.Thread(target=self._prepare, args=(prerequisite,), name="tidal-model-upgrade",
                         daemon=True).start()

    def _prepare(self, prerequisite: Future | None) -> None:
        try:
            go = prerequisite is None or prerequisite.result() is not None
            if go and self.wait is not None:
                go = self.wait()
            model = self.make_model() if go else None
        except Exception:  # keep serving on what serves now
            logger.exception("could not prepare the upgraded CPU model")
            model = None
        self.future.set_result(model)

    def ready(self) -> bool:
        return self.future.done()

    def model(self) -> Model | None:
        """The upgraded model, or ``None`` where there is nothing to swap in."""
        return self.future.result()


class IdleWait:
    """Waits for a re-time: ``delay`` seconds, then until no step has run for ``IDLE_S``.
    ``last_step`` gives the ``time.monotonic()`` of the latest step. Every wait is
    cancelled when the interpreter exits: a re-time must not start loading a model then."""

    def __init__(self, delay: float, last_step: Callable[[], float]) -> None:
        self.delay = delay
        self.last_step = last_step
        self.cancelled = threading.Event()
        _WAITS.add(self)

    def __call__(self) -> bool:
        if self.cancelled.wait(self.delay):
            return False
        while time.monotonic() - self.last_step() < IDLE_S:
            if self.cancelled.wait(IDLE_S / 4):
                return False
        return True


_WAITS: weakref.WeakSet[IdleWait] = weakref.WeakSet()


@atexit.register
def _cancel_waits() -> None:
    for wait in list(_WAITS):
        wait.cancelled.set()


def next_delay(delay: float) -> float:
    return min(RETIME_AT_MOST_S, max(RETIME_AFTER_S, 2 * delay))


class CpuUpgrades(Generic[Model]):
    """One runner's CPU model upgrades: which the first load needs (``start``), the one in
    flight, and the re-times of provisional plans after each model arrives.

    ``load(timed, cache, serving)`` loads the model (its plans timed, or untimed defaults;
    ``serving``, the model that serves meanwhile, may lend it weights), ``plans`` gives a
    loaded model's plans (None off the kernels), ``signature`` names the model's shapes and
    settings in the plan cache, ``last_step`` the time of the latest step."""

    def __init__(self, load: Callable[[bool, PlanCache | None, Model | None], Model],
                 plans: Callable[[Model], list[Plan] | None], signature: str,
                 last_step: Callable[[], float]) -> None:
        self.load, self.plans, self.signature = load, plans, signature
        self.last_step = last_step
        self.pending: ModelUpgrade[Model] | None = None
        self.retiming = False  # the pending upgrade re-times provisional plans
        self.delay = 0.0  # the wait before the next re-time of provisional plans
        self.slow_delay = 0.0  # the wait before the next re-time for slow steps
        self.current: list[Plan] = []  # the plans of the model that serves
        # the plans (by identity) of a model loaded by a re-time whose noisy timings the
        # re-time confirmed: the cache holds them confirmed, the model as they were timed
        self._confirmed: set[int] = set()
        self.waiting: str | None = None  # what the first model waits for: kernels, plans
        self._wait: IdleWait | None = None
        self.serving: Model | None = None  # the model that serves now

    def start(self) -> Model:
        """The first model: untimed while the kernels build or its plans are timed in the
        background, else planned now (from this host's cache where it has them)."""
        if needs_background_build():
            self.pending, self.waiting = ModelUpgrade.for_kernels(self._timed), "kernels"
        elif selector.mode() == "auto" and not PlanCache().knows_model(self.signature):
            # read after the first model, not beside it: two loads at once peak twice
            self.serving, self.waiting = self.load(False, None, None), "plans"
            self.pending = ModelUpgrade(self._timed, "this model's CPU plans are timed in the "
                                        "background, on untimed defaults meanwhile")
            return self.serving
        if self.pending is not None:
            self.serving = self.load(False, None, None)
            return self.serving
        model = self.serving = self._timed()
        self._after(model)
        return model

    def poll(self) -> Model | None:
        """Between steps: the upgraded model to swap in, once there is one."""
        if self.pending is None or not self.pending.ready():
            return None
        model, retimed = self.pending.model(), self.retiming
        self.pending, self.retiming, self.waiting = None, False, None
        if model is None:
            return None
        same = retimed and _choices(self.plans(model)) == _choices(self.current)
        self._after(model)
        if same:
            logger.info("CPU plans timed again: they stand")
            return None  # nothing to swap
        if retimed:
            logger.info("CPU plans timed again: swapping in the model on the new ones")
        self.serving = model
        return model

    def slow_steps(self) -> None:
        """The serving model's steps run slower than its plans said: time them all again
        once the engine idles (unless an upgrade is on its way already)."""
        if self.pending is not None or selector.mode() != "auto" or not self.current:
            return
        logger.info("decode steps run persistently slower than when their CPU plans came in: "
                    "timing them again once the engine idles")
        self.slow_delay = next_delay(self.slow_delay)  # never reset: each time waits longer
        self._retime(forget=list(self.current), delay=self.slow_delay)

    def retime_note(self) -> str:
        """For the kernels line: plans to be timed again, and whether that is done."""
        if not self.retiming or self.pending is None:
            return ""
        if self.pending.ready():
            return "; plans timed again, swapped in at the next step"
        return "; noisy plans to be timed again once idle"

    def cancel(self) -> None:
        if self._wait is not None:
            self._wait.cancelled.set()

    def _timed(self, retime: bool = False, forget: list[Plan] | None = None) -> Model:
        cache = PlanCache()
        noisy = cache.forget_provisional() if retime else {}
        if forget:
            cache.forget(forget)
        model = self.load(True, cache, self.serving)
        # a noisy plan timed a second time stands (PlanCache.confirm): no third timing
        self._confirmed |= {id(plan) for plan in cache.confirm(noisy)}
        plans = self.plans(model)
        if plans is not None:
            cache.record_model(self.signature, plans)
            cache.save()
        return model

    def _after(self, model: Model) -> None:
        """Schedule a re-time where ``model``'s plans were timed on a noisy host."""
        plans = self.current = self.plans(model) or []
        noisy = [p for p in plans if p.provisional and id(p) not in self._confirmed]
        if selector.mode() != "auto" or not noisy:
            self.delay = 0.0
            return
        self._retime()

    def _retime(self, forget: list[Plan] | None = None, delay: float | None = None) -> None:
        """Time the provisional plans (and ``forget``'s) again, after the next delay (or
        ``delay``) and once the engine idles."""
        if delay is None:
            self.delay = delay = next_delay(self.delay)
        self._wait = IdleWait(delay, self.last_step)
        self.retiming = True
        self.pending = ModelUpgrade(lambda: self._timed(retime=True, forget=forget),
                                    f"its CPU plans wait {delay:.0f} s and an idle engine "
                                    "to be timed again in the background", wait=self._wait)


def _choices(plans: list[Plan] | None) -> list[tuple]:
    return [(p.bounds, p.choices) for p in plans or []]


def plans_of(loaded: LoadedModel) -> list[Plan] | None:
    """A loaded CPU model's timed plans (None off the kernels, or untimed)."""
    cpu = loaded.cpu
    if cpu is None or not cpu.plans.timed:
        return None
    return list(cpu.plans.plans.values()) + ([cpu.stack_plan] if cpu.stack_plan else [])
