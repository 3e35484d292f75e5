"""The engine on its own thread, driven from an asyncio event loop.

The event loop hands the engine thread new requests and aborts through one thread-safe queue,
drained at the top of every step. The thread posts all of a step's outputs back with ONE
``loop.call_soon_threadsafe`` call (during the next step, just before its forward); each
request's ``RequestOutputCollector`` merges deltas its consumer has not taken yet. The thread
never touches asyncio objects except through that call, and the event loop never touches
scheduler state.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from tidal.core.config import EngineConfig
from tidal.core.engine_core import EngineCore
from tidal.core.engine_stats import EngineStats
from tidal.core.lifecycle import Arrival, RequestStats
from tidal.core.outputs import RequestOutput, RequestOutputCollector
from tidal.core.sampling_params import SamplingParams
from tidal.core.structured_output import StructuredOutputsParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down or crashed); no request can be served."""


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    arrival: Arrival | None = None


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Failed:
    """The executor lost a worker between steps: the engine thread must die."""

    error: BaseException


@dataclass
class _Call:
    """Run ``fn(core)`` on the engine thread between steps; its result (or exception) comes
    back to ``future`` on the event loop."""

    fn: Callable[[EngineCore], Any]
    future: asyncio.Future


_STOP = object()
# An engine idle this long gives the steps' freed host memory back to the OS (once per idle
# spell): a server holds its busy steps' working set only while it is busy.
IDLE_RELEASE_S = 2.0


class AsyncEngine:
    """``generate()`` is an async iterator of ``RequestOutput`` deltas for one request.

    Construct it (this loads the model), then ``start()`` it from the event loop that will
    consume its outputs; ``shutdown()`` stops the thread and fails in-flight requests.
    """

    def __init__(self, config: EngineConfig | None = None, core: EngineCore | None = None
                 ) -> None:
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._collectors: dict[str, RequestOutputCollector] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._launch: queue.SimpleQueue | None = None  # start() -> the waiting engine thread
        self._dead: BaseException | None = None
        self._pending: tuple[list, EngineStats] | None = None  # outputs not yet posted
        self._released = True  # False: steps ran since the host memory last went back
        self._calls: set[asyncio.Future] = set()  # _Call futures not yet resolved
        if core is None:
            if config is None:
                raise ValueError("AsyncEngine needs a config or an EngineCore")
            core = self._build_on_engine_thread(config)
        self.core = core
        core.executor.on_failure = lambda exc: self._inbox.put(_Failed(exc))
        self.tokenizer = core.tokenizer
        self.max_model_len = core.max_model_len
        self.stats: EngineStats = core.stats()  # a snapshot, replaced after every step
        # called on the event loop with each engine request that finished, whether or not
        # anyone still reads its outputs
        self.finished_listeners: list[Callable[[RequestStats], None]] = []

    def _build_on_engine_thread(self, config: EngineConfig) -> EngineCore:
        """Load the model on the thread that will run it, which then waits for ``start()``.

        All tensor work stays on one OS thread: once a second thread has run OpenMP regions
        (loading the model on the event loop's thread did), libgomp counts more workers than
        CPUs, stops spin-waiting, and every parallel op pays a futex wake-up; on a 2-core CPU
        that made each decode step 1.7x slower.
        """
        built: queue.SimpleQueue = queue.SimpleQueue()
        self._launch = queue.SimpleQueue()

        def build_then_run() -> None:
            try:
                built.put(EngineCore(config))
            except BaseException as exc:  # noqa: BLE001 - re-raised by the constructor
                built.put(exc)
                return
            if self._launch.get():  # False: shut down before it started
                self._run()

        self._thread = threading.Thread(target=build_then_run, name="tidal-engine",
                                        daemon=True)
        self._thread.start()
        core = built.get()
        if isinstance(core, BaseException):
            raise core
        return core

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._launch is not None:
            self._launch.put(True)
            return
        self._thread = threading.Thread(target=self._run, name="tidal-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        if self._loop is None and self._launch is not None:  # built but never started
            self._launch.put(False)
        self._inbox.put(_STOP)
        await asyncio.to_thread(self._thread.join, timeout)
        self._fail_all(EngineDeadError("the server is shutting down"))

    @property
    def is_alive(self) -> bool:
        return (self._dead is None and self._loop is not None and self._thread is not None
                and self._thread.is_alive())

    @property
    def error(self) -> BaseException | None:
        return self._dead

    # -- the asyncio side ---------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None, prompt: str | None = None,
                       arrival: Arrival | None = None) -> AsyncIterator[RequestOutput]:
        """Yield deltas until the request finishes. Leaving the iteration early (the client
        went away, the task was cancelled) aborts the request, which frees its KV blocks
        within one engine step. ``arrival`` says when the request reached the server, and
        its timeout."""
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running ({self._dead or 'not started'})")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._collectors:
            raise ValueError(f"request id {request_id!r} is already in use")
        collector = RequestOutputCollector()
        self._collectors[request_id] = collector
        self._inbox.put(_Add(request_id, list(prompt_token_ids), params, prompt, arrival))
        finished = False
        try:
            while not finished:
                out = collector.get_nowait() or await collector.get()
                finished = out.finished
                yield out
        finally:
            if self._collectors.pop(request_id, None) is not None and not finished:
                self.abort(request_id)

    async def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compile ``spec``'s grammar off the engine thread (the compiler's cache keeps it for
        the request that follows); raises ``GrammarError`` naming the field if it does not
        compile, so a server can answer 400 before it starts a stream."""
        await asyncio.wrap_future(self.core.structured.compiler.submit(spec))

    def abort(self, *request_ids: str) -> None:
        self._inbox.put(_Abort(list(request_ids)))

    async def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache on the engine thread (``EngineCore.reset_prefix_cache``)."""
        return await self._call(lambda core: core.reset_prefix_cache())

    async def _call(self, fn: Callable[[EngineCore], Any]) -> Any:
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running ({self._dead or 'not started'})")
        assert self._loop is not None
        future = self._loop.create_future()
        self._calls.add(future)
        self._inbox.put(_Call(fn, future))
        try:
            return await future
        finally:
            self._calls.discard(future)

    @staticmethod
    def _resolve(done: tuple[asyncio.Future, Any, BaseException | None]) -> None:
        """Runs on the event loop: settle a ``_Call``'s future."""
        future, result, exc = done
        if future.done():  # its caller was cancelled, or the engine died first
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)

    def _post(self, step: tuple[list[RequestOutput | tuple[str, BaseException]], EngineStats]
              ) -> None:
        """Runs on the event loop: hand each delta to its request's collector."""
        outputs, self.stats = step
        for out in outputs:
            if isinstance(out, tuple):
                request_id, exc = out
                collector = self._collectors.get(request_id)
                if collector is not None:
                    collector.put(exc)
                continue
            if out.finished_stats and self.finished_listeners:
                self._report_finished(out.finished_stats)
            collector = self._collectors.get(out.request_id)
            if collector is not None:
                collector.put(out)

    def _report_finished(self, finished: list[RequestStats]) -> None:
        for stats in finished:
            for listener in self.finished_listeners:
                try:
                    listener(stats)
                except Exception:  # a metric or a log line never stops the outputs
                    logger.exception("a finished-request listener failed")

    def _fail_all(self, exc: BaseException) -> None:
        for collector in self._collectors.values():
            collector.put(exc)
        for future in self._calls:
            if not future.done():
                future.set_exception(exc)

    # -- the engine thread --------------------------------------------------------------
    def _run(self) -> None:
        """Step while there is work. A step's outputs are posted during the next step, once
        its inputs are ready and just before its forward, which releases the GIL: the event
        loop then streams them while the model computes, instead of taking the GIL from the
        next step's scheduling. Outputs are posted at once when no step follows."""
        try:
            with self.core.step_modes():  # held for the thread's life, not entered per step
                self._step_until_stopped()
        except BaseException as exc:  # noqa: BLE001 - any crash must reach every waiter
            logger.exception("the engine thread died")
            self._dead = exc
            self._flush()
            self._call_loop(self._fail_all, EngineDeadError(f"the engine died: {exc!r}"))
        finally:
            self.core.shutdown()

    def _step_until_stopped(self) -> None:
        while True:
            idle = not self.core.has_unfinished_requests()
            if idle:
                self._flush()
            errors = self._drain(block=idle)
            if errors is None:
                self._flush()
                return
            outputs: list = list(errors)
            if self.core.has_unfinished_requests():
                outputs.extend(self.core.step(before_forward=self._flush_in_step))
                self._released = False
            step_done = time.monotonic()  # when these tokens were sampled, for latency
            for out in outputs:
                if isinstance(out, RequestOutput):
                    out.metrics["step_done"] = step_done
            self._flush()  # the step ran no forward, so nothing posted the last outputs
            self._pending = (outputs, self.core.stats())

    def _flush(self) -> None:
        """Post the outputs waiting for the event loop, if any."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._call_loop(self._post, pending)

    def _flush_in_step(self) -> None:
        self._flush()
        self.core.profiler.lap("post")

    def _wait_idle(self) -> object:
        """The next item for an idle engine; after ``IDLE_RELEASE_S`` without one, the host
        memory of the steps before goes back to the OS, then the wait goes on."""
        if not self._released:
            try:
                return self._inbox.get(timeout=IDLE_RELEASE_S)
            except queue.Empty:
                self._released = True
                self.core.release_host_memory()
        return self._inbox.get()

    def _drain(self, block: bool) -> list[tuple[str, BaseException]] | None:
        """Apply queued adds and aborts; ``None`` means stop. Returns per-request errors."""
        errors: list[tuple[str, BaseException]] = []
        while True:
            try:
                item = self._wait_idle() if block else self._inbox.get(block=False)
            except queue.Empty:
                return errors
            block = False
            if item is _STOP:
                self._dead = EngineDeadError("the engine was shut down")
                return None
            if isinstance(item, _Abort):
                self.core.abort_requests(item.request_ids)
                continue
            if isinstance(item, _Failed):
                raise item.error
            if isinstance(item, _Call):
                self._run_call(item)
                continue
            try:
                self.core.add_request(item.request_id, item.prompt_token_ids, item.params,
                                      prompt=item.prompt, arrival=item.arrival)
            except ValueError as exc:
                errors.append((item.request_id, exc))

    def _run_call(self, call: _Call) -> None:
        result, error = None, None
        try:
            result = call.fn(self.core)
        except Exception as exc:  # noqa: BLE001 - the caller gets it, the engine goes on
            error = exc
        self._call_loop(self._resolve, (call.future, result, error))

    def _call_loop(self, fn, arg) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, arg)
            except RuntimeError:  # the loop closed between the check and the call
                pass
