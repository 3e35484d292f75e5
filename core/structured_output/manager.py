"""The engine's side of constrained decoding: each constrained request's grammar compiles off
the engine thread while the request waits (``WAITING_FOR_GRAMMAR``); once it is running, every
step that samples it fills its row of the token bitmask from its matcher, and every token it
accepts advances the matcher, in order.

With speculative decoding a constrained request's proposals are first cut to the prefix its
grammar allows (``allowed_prefix``), and its step gets a bitmask row per proposed position:
the matcher is walked over the proposals to fill them and rolled back, so it holds only
accepted tokens when the verified ones are fed to it (docs/speculative-decoding.md)."""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING, Any

from tidal.core.request import Request
from tidal.core.scheduler_output import GrammarBitmask
from tidal.core.structured_output.compiler import (
    DEFAULT_CACHE_BYTES,
    DEFAULT_COMPILE_TIMEOUT,
    DEFAULT_COMPILE_WORKERS,
    GrammarCompiler,
    GrammarError,
)

if TYPE_CHECKING:
    import xgrammar as xgr


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], *,
                 compile_workers: int = DEFAULT_COMPILE_WORKERS,
                 compile_timeout: float | None = DEFAULT_COMPILE_TIMEOUT,
                 cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids,
                                        workers=compile_workers, timeout=compile_timeout,
                                        cache_bytes=cache_bytes)
        self.vocab_size = vocab_size
        self._pending: dict[str, Future] = {}  # request id -> its grammar, compiling
        self._matchers: dict[str, xgr.GrammarMatcher] = {}  # request id -> running matcher
        self._batcher: xgr.BatchGrammarMatcher | None = None

    @property
    def num_live(self) -> int:
        """Matchers and compiles held for unfinished requests (0 once all are done)."""
        return len(self._pending) + len(self._matchers)

    def add(self, request: Request) -> None:
        spec = request.sampling_params.structured_outputs
        assert spec is not None
        self._pending[request.request_id] = self.compiler.submit(spec)

    def resolve(self, request: Request) -> bool | GrammarError:
        """Whether ``request``'s grammar is ready (its matcher then made and replayed over any
        output it already has), or the error it failed with."""
        req_id = request.request_id
        if req_id in self._matchers:
            return True
        future = self._pending.get(req_id)
        if future is None or not future.done():
            return False
        del self._pending[req_id]
        try:
            compiled = future.result()
        except GrammarError as exc:
            return exc
        import xgrammar as xgr  # imported by the compile that made ``compiled``

        matcher = xgr.GrammarMatcher(compiled)
        for token_id in request.output_token_ids:
            matcher.accept_token(token_id)
        self._matchers[req_id] = matcher
        return True

    def wait_for_compiles(self, timeout: float) -> None:
        """Block until a pending grammar is compiled, at most ``timeout`` seconds: what an
        engine with nothing else to run does, rather than spin."""
        if self._pending:
            wait(list(self._pending.values()), timeout, return_when=FIRST_COMPLETED)

    def accept(self, req_id: str, token_id: int) -> bool:
        """Advance ``req_id``'s matcher by its sampled token. True when the grammar is then
        complete, so the request should stop."""
        matcher = self._matchers.get(req_id)
        if matcher is None:
            return False
        matcher.accept_token(token_id)  # False only for a token the mask did not allow
        return matcher.is_terminated()

    def remove(self, req_id: str) -> None:
        self._matchers.pop(req_id, None)
        self._pending.pop(req_id, None)  # the compile goes on: the cache shares it

    def allowed_prefix(self, req_id: str, tokens: list[int]) -> list[int]:
        """The longest prefix of ``tokens`` that ``req_id``'s grammar accepts without ending
        (a stop token is the target's to choose); the matcher is left as it was."""
        matcher = self._matchers.get(req_id)
        if matcher is None:
            return []
        n, ended = 0, False
        for token_id in tokens:
            if not matcher.accept_token(token_id):
                break
            n += 1
            ended = matcher.is_terminated()
            if ended:
                break
        if n:
            matcher.rollback(n)
        return tokens[:n - 1] if ended else tokens[:n]

    def bitmask(self, req_ids: list[str], drafts: dict[str, list[int]] | None = None
                ) -> GrammarBitmask | None:
        """The bitmask rows of the constrained requests among ``req_ids`` (those about to
        sample), or None when none is constrained: one row each, or with ``drafts`` (their
        proposals, which their grammars accept) one more per proposal, row ``j`` allowing
        what may follow the first ``j`` proposals."""
        rows = [r for r in req_ids if r in self._matchers]
        if not rows:
            return None
        import xgrammar as xgr

        drafts = drafts or {}
        num_rows = [1 + len(drafts.get(r, ())) for r in rows]
        bitmask = xgr.allocate_token_bitmask(sum(num_rows), self.vocab_size).numpy()
        matchers = [self._matchers[r] for r in rows]
        if len(matchers) > 1 and max(num_rows) == 1:
            if self._batcher is None:
                self._batcher = xgr.BatchGrammarMatcher(max_threads=1)
            self._batcher.batch_fill_next_token_bitmask(matchers, bitmask)
        else:
            start = 0
            for req_id, matcher in zip(rows, matchers):
                start = _fill_rows(matcher, drafts.get(req_id, []), bitmask, start)
        return GrammarBitmask(rows, bitmask, num_rows)

    def shutdown(self) -> None:
        self.compiler.shutdown()


def _fill_rows(matcher: xgr.GrammarMatcher, drafts: list[int], bitmask: Any, start: int
               ) -> int:
    """Fill rows ``start ..`` of ``bitmask``: the matcher's next tokens, then after each of
    ``drafts`` in turn; the matcher is rolled back. Returns the next free row."""
    matcher.fill_next_token_bitmask(bitmask, start)
    for j, token_id in enumerate(drafts, 1):
        accepted = matcher.accept_token(token_id)
        assert accepted, "a proposal the grammar refuses (allowed_prefix cuts those)"
        matcher.fill_next_token_bitmask(bitmask, start + j)
    if drafts:
        matcher.rollback(len(drafts))
    return start + 1 + len(drafts)
