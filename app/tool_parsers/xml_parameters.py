"""Qwen3-Coder's arguments: ``<parameter=P>\\nVALUE\\n</parameter>`` blocks, each value raw
text: how a value is typed into the JSON object of the call's ``arguments``, and the grammar
that has the model write them (``call_readers.ParametersReader`` reads them).

A value runs to the first ``</parameter>``; the newline after ``<parameter=P>`` and the one
before ``</parameter>`` are layout, not value. The one decision of how a value is typed,
shared by reading and grammar (``is_raw_string``): a parameter whose schema says it is a
string (``"type": "string"``, or an ``enum``/``const`` of strings) is the raw text as it
stands; any other is JSON (a number, ``true``, ``{...}``, ``[...]``, ``null``, a quoted
string). Without a schema, a value that parses as JSON is that JSON, any other the raw text.
"""

from __future__ import annotations

import json
import re
from typing import Any

OPEN, CLOSE = "<parameter=", "</parameter>"


def is_raw_string(schema: Any) -> bool:
    """Whether a parameter of ``schema`` is written as raw text."""
    if not isinstance(schema, dict):
        return False
    if "enum" in schema:
        values = schema["enum"]
        return isinstance(values, list) and bool(values) \
            and all(isinstance(v, str) for v in values)
    if "const" in schema:
        return isinstance(schema["const"], str)
    return schema.get("type") in ("string", ["string"])


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parameter_value(raw: str, schema: Any) -> Any:
    """One value as its schema types it (module docstring)."""
    if is_raw_string(schema):
        return raw
    try:
        return json.loads(raw, parse_constant=_no_constants)
    except (ValueError, RecursionError):
        return raw


def arguments_json(parameters: list[tuple[str, str]], schema: dict[str, Any] | None) -> str:
    """The arguments object of a call's ``(name, raw value)`` parameters."""
    properties = (schema or {}).get("properties")
    properties = properties if isinstance(properties, dict) else {}
    values = {name: parameter_value(raw, properties.get(name)) for name, raw in parameters}
    return json.dumps(values, ensure_ascii=False)


# -- the grammar -------------------------------------------------------------------------------
# Raw text as code-point ranges, which xgrammar compiles to exact UTF-8: tab, newline (TEXT
# only) and every character from the space on, surrogates aside.
TEXT = ((0x09, 0x0A), (0x20, 0xD7FF), (0xE000, 0x10FFFF))
LINE = ((0x09, 0x09), (0x20, 0xD7FF), (0xE000, 0x10FFFF))
NAME_PATTERN = "[A-Za-z_][A-Za-z0-9_.\\-]{0,63}"  # a parameter of a schema without properties


def parameters_format(schema: Any) -> dict[str, Any]:
    """The structural-tag format of a call's parameter blocks: the schema's properties in its
    order, the required ones always, each as ``<parameter=P>\\nVALUE\\n</parameter>\\n``. A
    schema without properties takes any parameters (with JSON values) unless it forbids
    additional ones."""
    schema = schema if isinstance(schema, dict) else {}
    properties = schema.get("properties")
    if not isinstance(properties, dict) or not properties:
        if schema.get("additionalProperties") is False:
            return {"type": "const_string", "value": ""}
        block = _block({"type": "regex", "pattern": NAME_PATTERN}, _json_format({}))
        return {"type": "star", "content": block}
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    required = set(schema.get("required") or ())
    elements = []
    for name, sub in properties.items():
        block = _block({"type": "const_string", "value": name}, value_format(sub, defs))
        elements.append(block if name in required else {"type": "optional", "content": block})
    return {"type": "sequence", "elements": elements}


def _block(name: dict[str, Any], value: dict[str, Any]) -> dict[str, Any]:
    return {"type": "sequence", "elements": [
        {"type": "const_string", "value": OPEN}, name, {"type": "const_string", "value": ">\n"},
        value, {"type": "const_string", "value": "\n" + CLOSE + "\n"}]}


def _json_format(schema: Any, defs: dict[str, Any] | None = None) -> dict[str, Any]:
    if defs and isinstance(schema, dict):
        schema = {**defs, **schema}  # a $ref into the root's definitions still resolves
    return {"type": "json_schema", "json_schema": schema}


def value_format(schema: Any, defs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One value: a raw string (``is_raw_string``) as its enum, pattern or length allow, any
    other as JSON on one line."""
    if not is_raw_string(schema):
        return _json_format(schema, defs)
    choices = schema["enum"] if "enum" in schema else [schema["const"]] \
        if "const" in schema else None
    if choices is not None:
        return {"type": "or", "elements": [{"type": "const_string", "value": v}
                                           for v in dict.fromkeys(choices)]}
    if isinstance(schema.get("pattern"), str):
        return {"type": "regex", "pattern": schema["pattern"]}
    return {"type": "regex", "pattern": raw_text_pattern(schema)}


def raw_text_pattern(schema: dict[str, Any]) -> str:
    """A string's raw text. Bounded by ``minLength``/``maxLength``: one line of that many
    characters, without ``<`` (so never ``</parameter>``, and counted exactly); unbounded:
    any lines that never hold ``</parameter>``."""
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    if "minLength" in schema or "maxLength" in schema:
        return f"{char_class(LINE, '<')}{{{lo},{'' if hi is None else hi}}}"
    return text_without(CLOSE, TEXT)


def text_without(marker: str, ranges: tuple[tuple[int, int], ...]) -> str:
    """A regex of the text over ``ranges`` in which ``marker`` never appears: each time its
    first character (which it holds once) starts a run of the marker's prefix, a character
    other than the marker's next one ends the run, or the next run starts."""
    first, rest = marker[0], marker[1:]
    assert first not in rest
    prefixes = [marker[:k] for k in range(1, len(marker))]
    runs = "|".join(re.escape(p) for p in prefixes)
    ends = "|".join(re.escape(p) + char_class(ranges, first + marker[len(p)])
                    for p in prefixes)
    return f"(?:{char_class(ranges, first)}|(?:{runs})*(?:{ends}))*(?:{runs})*"


def char_class(ranges: tuple[tuple[int, int], ...], without: str = "") -> str:
    """A regex character class of ``ranges`` less the characters of ``without``."""
    cuts = sorted({ord(c) for c in without})
    parts = []
    for lo, hi in ranges:
        for cut in cuts:
            if lo <= cut <= hi:
                if lo < cut:
                    parts.append((lo, cut - 1))
                lo = cut + 1
        if lo <= hi:
            parts.append((lo, hi))
    return "[" + "".join(_char(lo) if lo == hi else f"{_char(lo)}-{_char(hi)}"
                         for lo, hi in parts) + "]"


def _char(code: int) -> str:
    """A code point in a class: escaped in the basic plane, itself beyond it."""
    return f"\\u{code:04X}" if code <= 0xFFFF else chr(code)
