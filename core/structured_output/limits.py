"""Bounds on the size of a grammar a request may ask for, checked before anything compiles it
or even hashes it: a schema nested hundreds deep crashed the cache key's ``json.dumps`` with a
``RecursionError``, and a 50,000-value enum compiled for 92 s and held 68 MB (on a 512-token
vocabulary; far more on a real one).

Every check walks the constraint with an explicit stack, never recursing, so no input can
exhaust Python's stack here. The limits, and why (docs/robustness.md):

- ``MAX_DEPTH``: JSON objects and arrays nested in a schema or structural tag, 64 (a nested
  schema costs two: the schema and its ``properties``, so about 32 levels of schemas; OpenAI
  allows 10).
- ``MAX_NODES``: JSON values in one, 20,000 (OpenAI allows 5,000 object properties).
- ``MAX_ENUM_VALUES``: ``enum`` entries, ``const`` values and ``choice`` strings, 1,000 in all
  (OpenAI's bound).
- ``MAX_REPEAT``: a repetition count, ``{m,n}`` in a regex or pattern, ``minLength``,
  ``maxLength``, ``minItems``, ``maxItems``: 4,096 (a pattern of ``{0,20000}`` compiled for
  18 s).
- ``MAX_CHARS``: characters of text in the constraint (a regex, an EBNF grammar, the strings of
  a schema), 262,144.
- ``MAX_RULES``: rules of an EBNF grammar, 1,000.

What passes these can still be slow to compile (nested repetitions multiply): the compiler's
time limit (``GrammarCompiler``'s ``timeout``) is the backstop.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 64
MAX_NODES = 20_000
MAX_ENUM_VALUES = 1_000
MAX_REPEAT = 4_096
MAX_CHARS = 262_144
MAX_RULES = 1_000
REPEAT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties",
                   "maxProperties", "minContains", "maxContains")
_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_RULE = re.compile(r"::=")


class GrammarError(ValueError):
    """A grammar that does not compile, or is too large to try; ``param`` names the request
    field it came from. ``code`` says which: None for a compile error."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def too_large(param: str, what: str) -> GrammarError:
    return GrammarError(f"{param} is too large: {what}", param, code="grammar_too_large")


def parse_json(text: str, param: str) -> Any:
    """A constraint given as JSON text, parsed; a nesting too deep for the parser is the
    request's error, like any other invalid JSON."""
    try:
        return json.loads(text)
    except RecursionError:
        raise too_large(param, f"nested more than {MAX_DEPTH} levels deep") from None
    except ValueError as exc:
        raise GrammarError(f"{param} is not valid JSON: {exc}", param) from None


def check_text(text: str, param: str, rules: bool = False) -> None:
    """A regex, pattern or EBNF grammar: its length, its repetition counts and (EBNF) its
    rules."""
    if len(text) > MAX_CHARS:
        raise too_large(param, f"{len(text)} characters, more than {MAX_CHARS}")
    check_repeats(text, param)
    if rules:
        count = len(_RULE.findall(text))
        if count > MAX_RULES:
            raise too_large(param, f"{count} rules, more than {MAX_RULES}")


def check_repeats(text: str, param: str) -> None:
    for match in _QUANTIFIER.finditer(text):
        for bound in match.groups():
            if bound and int(bound) > MAX_REPEAT:
                raise too_large(param, f"a repetition of {bound}, more than {MAX_REPEAT}")


def check_choices(choices: list[str], param: str) -> None:
    if len(choices) > MAX_ENUM_VALUES:
        raise too_large(param, f"{len(choices)} choices, more than {MAX_ENUM_VALUES}")
    chars = sum(len(c) for c in choices)
    if chars > MAX_CHARS:
        raise too_large(param, f"{chars} characters of choices, more than {MAX_CHARS}")


def check_document(doc: Any, param: str) -> None:
    """A JSON schema or structural tag: its depth, its size, its enum values, its repetition
    counts and the text of its strings. Iterative: any depth is refused, never recursed into."""
    nodes = enum_values = chars = 0
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise too_large(param, f"more than {MAX_NODES} JSON values")
        if isinstance(value, str):
            chars += len(value)
            if chars > MAX_CHARS:
                raise too_large(param, f"more than {MAX_CHARS} characters of text")
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_DEPTH:
            raise too_large(param, f"nested more than {MAX_DEPTH} levels deep")
        if isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)
            continue
        for key, item in value.items():
            chars += len(key)
            if key == "enum" and isinstance(item, list):
                enum_values += len(item)
            elif key == "const":
                enum_values += 1
            elif key == "pattern" and isinstance(item, str):
                check_repeats(item, param)
            elif key in REPEAT_KEYWORDS and isinstance(item, int) and item > MAX_REPEAT:
                raise too_large(param, f"{key} {item}, more than {MAX_REPEAT}")
            if enum_values > MAX_ENUM_VALUES:
                raise too_large(param, f"more than {MAX_ENUM_VALUES} enum and const values")
            stack.append((item, depth + 1))
