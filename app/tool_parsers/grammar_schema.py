"""Tool schemas as they are handed to xgrammar.

xgrammar (through 0.2.8, mlc-ai/xgrammar#800) compiles a string with ``minLength`` or
``maxLength`` to a bare character class that admits raw control characters, which no strict
JSON parser takes. The same bound written as a ``pattern`` goes through its JSON-aware regex
path: no control characters, no ``"``, ``\\`` or newline either, a subset of what the schema
allows, so what the model writes still validates against the tool's own schema. (That path
admits overlong UTF-8 forms, which a model trained on UTF-8 text doesn't write; raw tabs in
length-bounded strings are what models do write.)
"""

from __future__ import annotations

from typing import Any

_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


def grammar_schema(schema: Any) -> Any:
    if isinstance(schema, list):
        return [grammar_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in _DATA_KEYWORDS else grammar_schema(value)
           for key, value in schema.items()}
    return _bounded_string_as_pattern(out)


def _bounded_string_as_pattern(schema: dict[str, Any]) -> dict[str, Any]:
    low, high = schema.get("minLength"), schema.get("maxLength")
    bounded = isinstance(low, int) or isinstance(high, int)
    if not bounded or "pattern" in schema or "format" in schema:
        return schema
    out = {k: v for k, v in schema.items() if k not in ("minLength", "maxLength")}
    low = low if isinstance(low, int) else 0
    out["pattern"] = f"^.{{{low},{high if isinstance(high, int) else ''}}}$"
    return out
