"""What a request's output must match, as vLLM's ``structured_outputs`` names it. The API's
``response_format`` and ``tools`` are translated into one of these."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from tidal.core.structured_output import limits

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of the constraints. ``field`` is the request field it came from, named in
    the error when the grammar does not compile (``response_format``, ``tools``, ...).

    Construction checks the constraint's size (``limits``: a ``GrammarError`` naming
    ``field``) and computes its cache key, so both happen where the request is prepared, off
    the event loop, and ``key()`` costs nothing wherever it is asked."""

    json: dict | str | None = None  # a JSON schema
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF style), as xgrammar takes it
    structural_tag: dict | str | None = None  # xgrammar's structural tag
    field: str = "structured_outputs"

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"{self.field} must set exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(given) or 'none'}")
        if self.choice is not None and not (
                self.choice and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"{self.field}.choice must be a non-empty list of non-empty "
                             "strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"{self.field}.{name} must be a non-empty string")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"{self.field}.json must be a JSON schema (an object)")
        object.__setattr__(self, "_key", self._checked_key())

    def _checked_key(self) -> tuple[str, str]:
        """The size limits, then the cache key: the kind and a digest of the canonical text
        (a digest, so a large schema is not held twice by the cache)."""
        kind, field = self.kind, self.field
        value: Any = getattr(self, kind)
        if kind in ("json", "structural_tag"):
            if isinstance(value, str):
                limits.check_text(value, field)  # its length, before parsing it
                value = limits.parse_json(value, field)
            limits.check_document(value, field)
        elif kind in ("regex", "grammar"):
            limits.check_text(value, field, rules=kind == "grammar")
        elif kind == "choice":
            limits.check_choices(value, field)
        if isinstance(value, (dict, list)):
            value = json.dumps(value, sort_keys=True, separators=(",", ":"))
        return kind, hashlib.sha256(str(value).encode()).hexdigest()

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def as_format(self) -> dict[str, Any]:
        """The constraint as one format of xgrammar's structural tag, so that it can follow
        something else in one grammar (a reasoning model's thinking: app/reasoning.py)."""
        kind, value = self.kind, getattr(self, self.kind)
        if isinstance(value, str) and kind in ("json", "structural_tag"):
            value = json.loads(value)
        if kind == "json":
            return {"type": "json_schema", "json_schema": value}
        if kind == "json_object":
            return {"type": "json_schema", "json_schema": {"type": "object"}}
        if kind == "regex":
            return {"type": "regex", "pattern": value}
        if kind == "grammar":
            return {"type": "grammar", "grammar": value}
        if kind == "choice":
            return {"type": "or", "elements": [{"type": "const_string", "value": c}
                                               for c in value]}
        if not isinstance(value, dict) or not isinstance(value.get("format"), dict):
            raise ValueError(f"{self.field} must be a structural tag with a 'format' to "
                             "follow a reasoning model's thinking")
        return value["format"]

    def key(self) -> tuple[str, str]:
        """What identifies the grammar in the compile cache: its kind and a digest of its
        canonical text (computed at construction)."""
        return self._key  # type: ignore[attr-defined]
