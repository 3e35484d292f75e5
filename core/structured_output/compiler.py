"""Grammars compiled by xgrammar on a small thread pool, never on the engine thread, with a
cache keyed by the grammar (the compiler is built for one tokenizer, so the key needs no
tokenizer part). A failed compile is cached too: the same bad schema fails at once.

xgrammar rather than llguidance: see ``bench/grammar_backends.py`` and docs/structured-outputs.md
for what was measured on this project's vocabularies.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from core.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)
CACHE_ENTRIES = 512
DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})  # values, not schemas
# a character a JSON string may hold unescaped (no control character, quote or backslash),
# as ranges of code points: xgrammar turns those into exact UTF-8 byte ranges, where ``.`` or
# ``[^...]`` let through overlong and surrogate byte sequences, and a pattern's class may
# hold a raw quote. (U+10FFFF is the character itself: xgrammar's regex has no \\U escape.)
JSON_CHAR = "[\\u0020-\\u0021\\u0023-\\u005B\\u005D-\\uD7FF\\uE000-\U0010FFFF]"


class GrammarError(ValueError):
    """A grammar that does not compile; ``param`` names the request field it came from."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class GrammarCompiler:
    """JSON is compiled in one layout, ``{"key": value, ...}`` on one line (OpenAI's, and what
    models mostly write): free whitespace lets a model fill ``max_tokens`` with newlines.

    Compiles on one worker thread. xgrammar is imported, and the tokenizer's vocabulary
    read, by the first compile: a server that never sees a constrained request pays neither
    (the import alone takes seconds)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 threads: int = 2) -> None:
        self.vocab_size = vocab_size
        self._tokenizer, self._stop_token_ids, self._threads = tokenizer, stop_token_ids, threads
        self._compiler: xgr.GrammarCompiler | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tidal-grammar")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """The compiled grammar of ``spec`` as a future (done at once when cached). Its
        exception is a ``GrammarError``."""
        key = spec.key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[key] = future
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return future

    def _setup(self) -> xgr.GrammarCompiler:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(
            self._tokenizer, vocab_size=self.vocab_size,
            stop_token_ids=self._stop_token_ids or None)
        logger.info("structured outputs: xgrammar over a %d-token vocabulary", self.vocab_size)
        return xgr.GrammarCompiler(info, max_threads=self._threads)

    def _compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        if self._compiler is None:
            self._compiler = self._setup()
        try:
            return self._compile_kind(spec)
        except Exception as exc:  # noqa: BLE001 - every failure is the request's grammar
            raise GrammarError(f"{_field(spec)} does not compile: {_message(exc)}",
                               _field(spec)) from None

    def _compile_kind(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        c = self._compiler
        assert c is not None
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
        self._pool.shutdown(wait=False, cancel_futures=True)


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
