"""The decode steps' thread count follows a co-tenant: a host whose cores another process keeps
busy runs the steps on one thread fewer where that is faster, and back on all of them once it
is not; a quiet host keeps all of them."""

from __future__ import annotations

import random

from tidal.gpu.cpu import thread_governor
from tidal.gpu.cpu.step_watch import StepWatch
from tidal.gpu.cpu.thread_governor import ThreadGovernor


class Host:
    """Step times over their baseline by thread count, with noise; records the counts set."""

    def __init__(self, times: dict[int, float], seed: int = 0) -> None:
        self.times, self.rng, self.threads, self.set = times, random.Random(seed), 2, []

    def set_threads(self, n: int) -> None:
        self.threads = n
        self.set.append(n)

    def step(self) -> float:
        return self.times[self.threads] * self.rng.uniform(0.9, 1.1)


def _run(governor: ThreadGovernor, host: Host, steps: int) -> None:
    for _ in range(steps):
        governor.observe(host.step())


def test_a_quiet_host_keeps_every_thread_and_probes_rarely() -> None:
    host = Host({2: 1.0, 1: 1.4})
    governor = ThreadGovernor(2, host.set_threads)
    _run(governor, host, 3 * thread_governor.PROBE_EVERY)
    assert governor.current == 2 and host.threads == 2
    probes = host.set.count(1) // thread_governor.ROUNDS
    assert 2 <= probes <= 4  # after 64 steps, then (a clear answer) every PROBE_EVERY


def test_a_co_tenant_moves_the_steps_to_one_thread_fewer_and_back() -> None:
    host = Host({2: 1.0, 1: 1.4})
    governor = ThreadGovernor(2, host.set_threads)
    _run(governor, host, 100)
    host.times = {2: 8.0, 1: 1.6}  # a co-tenant: every op waits for a descheduled part
    _run(governor, host, 8 * thread_governor.WINDOW)  # a slow window, then the probe
    assert governor.current == 1 and host.threads == 1
    host.times = {2: 1.0, 1: 1.4}  # it left: the next probe goes back
    _run(governor, host, thread_governor.PROBE_EVERY + 8 * thread_governor.WINDOW)
    assert governor.current == 2 and host.threads == 2


def test_a_slow_host_that_fewer_threads_do_not_help_keeps_every_thread() -> None:
    host = Host({2: 3.0, 1: 3.3})  # slow, but not from waiting on parts
    governor = ThreadGovernor(2, host.set_threads)
    _run(governor, host, 20 * thread_governor.WINDOW)
    assert governor.current == 2 and host.threads == 2 and 1 in host.set


def test_one_core_has_nothing_to_govern() -> None:
    host = Host({1: 9.0})
    host.threads = 1
    governor = ThreadGovernor(1, host.set_threads)
    _run(governor, host, 100)
    assert host.set == []


def test_the_step_watch_hands_its_steps_to_the_governor() -> None:
    host = Host({2: 1.0, 1: 0.3})
    watch = StepWatch(threads=2, set_threads=host.set_threads)
    for _ in range(40 * thread_governor.WINDOW):  # 1 ms steps, then on one thread faster
        watch.observe(4, 100, host.step())
        if len(host.set) == 0 and watch.baseline:
            host.times = {2: 5.0, 1: 1.2}
    assert watch.governor.current == 1 and host.threads == 1
