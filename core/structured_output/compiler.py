"""Grammars compiled by xgrammar on a few worker threads, never on the engine thread, with a
cache keyed by the grammar (the compiler is built for one tokenizer, so the key needs no
tokenizer part). A failed compile is cached too: the same bad schema fails at once.

Compiles are bounded three ways (docs/robustness.md): their size before they start
(``limits``, checked when the request's ``StructuredOutputsParams`` is built), their time
(a compile still running ``timeout`` seconds after it started fails with a ``GrammarError``,
and a worker takes its place while it finishes, so a slow grammar does not hold up the others;
the compiling threads run at a lower priority than serving, and one past its limit at the
lowest),
and the cache's memory (``cache_bytes``, by each compiled grammar's own size estimate; least
recently used first out). xgrammar's own compiler cache, which has no bound, is off.

xgrammar rather than llguidance: see ``bench/grammar_backends.py`` and docs/structured-outputs.md
for what was measured on this project's vocabularies.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import os
import queue
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from tidal.core.structured_output.limits import GrammarError
from tidal.core.structured_output.params import StructuredOutputsParams
from tidal.core.structured_output.special_tokens import MAX_COMPILERS, TextTokens

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)
DEFAULT_COMPILE_TIMEOUT = 15.0  # seconds a compile may run
DEFAULT_COMPILE_WORKERS = 4
DEFAULT_CACHE_BYTES = 256 << 20
ENTRY_OVERHEAD = 512  # bytes charged per cache entry besides the grammar (key, future, node)
DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})  # values, not schemas
# a character a JSON string may hold unescaped (no control character, quote or backslash),
# as ranges of code points: xgrammar turns those into exact UTF-8 byte ranges, where ``.`` or
# ``[^...]`` let through overlong and surrogate byte sequences, and a pattern's class may
# hold a raw quote. (U+10FFFF is the character itself: xgrammar's regex has no \\U escape.)
JSON_CHAR = "[\\u0020-\\u0021\\u0023-\\u005B\\u005D-\\uD7FF\\uE000-\U0010FFFF]"


# Compiles yield the CPU to serving (the engine's steps, the event loop): their threads run at
# this niceness, and a compile past its time limit, which nothing waits for any more, at the
# lowest. Linux gives a thread its own niceness; elsewhere this is a no-op.
WORKER_NICENESS = 10
STUCK_NICENESS = 19


class _Job:
    __slots__ = ("spec", "future", "key", "started", "thread_id")

    def __init__(self, spec: StructuredOutputsParams, future: Future, key: tuple[str, str]
                 ) -> None:
        self.spec, self.future, self.key = spec, future, key
        self.started: float | None = None
        self.thread_id = 0  # the native id of the thread compiling it


class GrammarCompiler:
    """JSON is compiled in one layout, ``{"key": value, ...}`` on one line (OpenAI's, and what
    models mostly write): free whitespace lets a model fill ``max_tokens`` with newlines.

    Compiles on ``workers`` threads (xgrammar releases the GIL while it compiles). xgrammar is
    imported, and the tokenizer's vocabulary read, by the first compile: a server that never
    sees a constrained request pays neither (the import alone takes seconds)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 threads: int = 2, *, workers: int = DEFAULT_COMPILE_WORKERS,
                 timeout: float | None = DEFAULT_COMPILE_TIMEOUT,
                 cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.vocab_size = vocab_size
        self.workers, self.timeout, self.cache_bytes = max(1, workers), timeout, cache_bytes
        self._tokenizer, self._stop_token_ids, self._threads = tokenizer, stop_token_ids, threads
        self._text_tokens: TextTokens | None = None
        # per set of special tokens read as text (special_tokens.py), least recently used first
        self._compilers: OrderedDict[frozenset[int], xgr.GrammarCompiler] = OrderedDict()
        self._setup_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._sizes: dict[tuple[str, str], int] = {}  # bytes charged per cache entry
        self.cache_size = 0  # bytes of all entries
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads_alive = 0
        self._stuck = 0  # workers still inside a compile that ran past the time limit
        self._deadlines: list[tuple[float, int, _Job]] = []  # running compiles, for the watchdog
        self._order = itertools.count()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self.num_timeouts = 0
        self._watchdog: threading.Thread | None = None

    # -- the cache ----------------------------------------------------------------------
    def submit(self, spec: StructuredOutputsParams) -> Future:
        """The compiled grammar of ``spec`` as a future (done at once when cached). Its
        exception is a ``GrammarError``."""
        key = spec.key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = Future()
            future.set_running_or_notify_cancel()
            self._cache[key] = future
            self._charge(key, ENTRY_OVERHEAD)
            self._start_workers()
        self._jobs.put(_Job(spec, future, key))
        return future

    def _charge(self, key: tuple[str, str], size: int) -> None:
        """Set ``key``'s entry's size, then evict the least recently used entries (never the
        one just charged) until the cache is within its bound. Holds ``_lock``."""
        self.cache_size += size - self._sizes.get(key, 0)
        self._sizes[key] = size
        while self.cache_size > self.cache_bytes and len(self._cache) > 1:
            oldest = next(iter(self._cache))
            if oldest == key:
                self._cache.move_to_end(key)
                oldest = next(iter(self._cache))
            self._cache.pop(oldest)
            self.cache_size -= self._sizes.pop(oldest)
        if self.cache_size > self.cache_bytes:  # a grammar larger than the whole cache
            self._cache.pop(key, None)
            self.cache_size -= self._sizes.pop(key)

    def _settle(self, job: _Job, result: Any, error: BaseException | None) -> bool:
        """A compile ended: its future's result and its entry's size, unless the watchdog
        failed it first. Returns whether this worker should leave: it was replaced while its
        compile ran over time, and the workers are enough without it."""
        with self._lock:
            if job.future.done():  # failed by the watchdog: this worker was counted stuck
                self._stuck -= 1
                if self._threads_alive - self._stuck > self.workers:
                    self._threads_alive -= 1
                    return True
                return False
            if self._cache.get(job.key) is job.future:  # charged before anyone sees it
                size = ENTRY_OVERHEAD
                if error is None:
                    size += int(getattr(result, "memory_size_bytes", 0) or 0)
                self._charge(job.key, size)
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(result)
            return False

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    # -- the workers --------------------------------------------------------------------
    def _start_workers(self) -> None:
        """Enough workers that ``workers`` of them are free of over-time compiles (holds
        ``_lock``)."""
        while self._threads_alive - self._stuck < self.workers and not self._closed:
            self._threads_alive += 1
            threading.Thread(target=self._work, name="tidal-grammar", daemon=True).start()
        if self.timeout is not None and self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="tidal-grammar-watchdog",
                                              daemon=True)
            self._watchdog.start()

    def _work(self) -> None:
        renice(threading.get_native_id(), WORKER_NICENESS)
        while True:
            job = self._jobs.get()
            if job is None:
                with self._lock:
                    self._threads_alive -= 1
                return
            try:  # xgrammar's import and the vocabulary: not the grammar's time
                self._compiler_for(job.spec)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiters
                self._settle(job, None, exc)
                continue
            with self._lock:
                job.started = time.monotonic()
                job.thread_id = threading.get_native_id()
                if self.timeout is not None:
                    heapq.heappush(self._deadlines, (job.started + self.timeout,
                                                     next(self._order), job))
                    self._wake.notify()
            try:
                result, error = self._compile(job.spec), None
            except BaseException as exc:  # noqa: BLE001 - handed to the waiters
                result, error = None, exc
            if self._settle(job, result, error):
                return

    def _watch(self) -> None:
        """Fail every compile still running ``timeout`` seconds after it started (a cached
        failure: the same grammar fails at once next time), and start a worker in its place:
        xgrammar cannot be interrupted, so the thread finishes the compile and then leaves."""
        assert self.timeout is not None
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                while self._deadlines and (self._deadlines[0][2].future.done()
                                           or self._deadlines[0][0] <= now):
                    _, _, job = heapq.heappop(self._deadlines)
                    if job.future.done():
                        continue
                    self.num_timeouts += 1
                    job.future.set_exception(GrammarError(
                        f"{job.spec.field} did not compile within {self.timeout:g} s; "
                        "simplify it", job.spec.field, code="grammar_too_complex"))
                    self._stuck += 1
                    renice(job.thread_id, STUCK_NICENESS)
                    logger.warning("a grammar compile passed %.1f s (%s); a worker replaces it",
                                   self.timeout, job.spec.field)
                    # the compile goes on on the stuck worker: twice the workers at most
                    if self._threads_alive < 2 * self.workers:
                        self._start_workers()
                wait = self._deadlines[0][0] - now if self._deadlines else None
                self._wake.wait(wait)

    def _compiler_for(self, spec: StructuredOutputsParams) -> xgr.GrammarCompiler:
        """The compiler whose vocabulary reads as text no special token but the markers
        ``spec``'s grammar writes (``special_tokens``), built on first use."""
        import xgrammar as xgr

        with self._setup_lock:
            if self._text_tokens is None:  # xgrammar's import and the vocabulary, once
                self._text_tokens = TextTokens(self._tokenizer, self.vocab_size,
                                               self._stop_token_ids)
                logger.info("structured outputs: xgrammar over a %d-token vocabulary",
                            self.vocab_size)
            kept = self._text_tokens.kept(spec)
            compiler = self._compilers.get(kept)
            if compiler is None:
                # no cache of its own: it has no bound, and ours does the job
                compiler = xgr.GrammarCompiler(self._text_tokens.info(kept),
                                               max_threads=self._threads, cache_enabled=False)
                self._compilers[kept] = compiler
                while len(self._compilers) > MAX_COMPILERS:
                    self._compilers.popitem(last=False)
            self._compilers.move_to_end(kept)
            return compiler

    def _compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        try:
            return self._compile_kind(spec)
        except Exception as exc:  # noqa: BLE001 - every failure is the request's grammar
            raise GrammarError(f"{_field(spec)} does not compile: {_message(exc)}",
                               _field(spec)) from None

    def _compile_kind(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        c = self._compiler_for(spec)
        if spec.json is not None:
            schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
            return c.compile_json_schema(_dumps(bounded_strings(schema)), any_whitespace=False)
        if spec.json_object:
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.regex is not None:
            return c.compile_regex(spec.regex)
        if spec.choice is not None:
            return c.compile_regex("|".join(re.escape(choice) for choice in spec.choice))
        if spec.grammar is not None:
            return c.compile_grammar(spec.grammar)
        tag = json.loads(spec.structural_tag) if isinstance(spec.structural_tag, str) \
            else spec.structural_tag
        return c.compile_structural_tag(structural_tag_json(tag))

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            alive = self._threads_alive
            self._wake.notify_all()
        while True:  # queued compiles fail rather than hang their waiters
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._settle(job, None, GrammarError("the engine is shutting down",
                                                     job.spec.field))
        for _ in range(alive):
            self._jobs.put(None)


def renice(thread_id: int, niceness: int) -> None:
    """Lower a thread's priority to ``niceness`` (never raise it: that needs privileges)."""
    try:
        current = os.getpriority(os.PRIO_PROCESS, thread_id)
        if niceness > current:
            os.setpriority(os.PRIO_PROCESS, thread_id, niceness)
    except (AttributeError, OSError):  # no setpriority here, or the thread is gone
        pass


def bounded_strings(schema: Any) -> Any:
    """``schema`` with each length-bounded string's bounds given as a pattern instead.

    xgrammar compiles a string with ``minLength``/``maxLength`` into raw characters that
    include control characters, which JSON forbids unescaped, and byte sequences that are not
    UTF-8; a pattern is compiled as a JSON string's characters, and ``JSON_CHAR`` is exact
    UTF-8. The lengths stay the same."""
    if isinstance(schema, list):
        return [bounded_strings(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in DATA_KEYWORDS else bounded_strings(value)
           for key, value in schema.items()}
    lo, hi = out.get("minLength", 0), out.get("maxLength")
    bounded = "minLength" in out or "maxLength" in out
    free = not any(key in out for key in ("pattern", "format", "enum", "const"))
    whole = isinstance(lo, int) and (hi is None or isinstance(hi, int))
    if out.get("type") == "string" and bounded and free and whole:
        out.pop("minLength", None)
        out.pop("maxLength", None)
        out["pattern"] = f"^{JSON_CHAR}{{{lo},{'' if hi is None else hi}}}$"
    return out


def xgrammar_structural_tag(tag: Any) -> Any:
    """A structural tag with each JSON schema in it replaced by the grammar of that schema's
    JSON on one line (``bounded_strings`` applied): a structural tag's own JSON takes any
    whitespace between tokens."""
    import xgrammar as xgr

    if isinstance(tag, list):
        return [xgrammar_structural_tag(item) for item in tag]
    if not isinstance(tag, dict):
        return tag
    if tag.get("type") == "json_schema" and "json_schema" in tag:
        schema = _dumps(bounded_strings(tag["json_schema"]))
        return {"type": "grammar",
                "grammar": str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))}
    return {key: xgrammar_structural_tag(value) for key, value in tag.items()}


def structural_tag_json(tag: Any) -> str:
    """The structural tag as xgrammar's compiler takes it (``xgrammar_structural_tag``)."""
    return _dumps(xgrammar_structural_tag(tag))


def _dumps(value: Any) -> str:
    """JSON for xgrammar, non-ASCII characters as themselves (``JSON_CHAR`` holds one)."""
    return json.dumps(value, ensure_ascii=False)


def _field(spec: StructuredOutputsParams) -> str:
    return spec.field


def _message(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:500] if text else type(exc).__name__
