"""Reading one tool call out of a reply as its text arrives, from just after its trigger (or
the list's separator) to its last character: a JSON object naming the function, or the
function's bare name between markers, then its arguments: a JSON object, or Qwen3-Coder's
parameter blocks (``ParametersReader``; ``xml_parameters.py`` types their values).

A reader is fed the whole text so far and the position it stopped at, and answers MORE while
the text does not yet tell (the splitter drops the call if the reply ends there), BROKEN where
the text cannot be a call (it is content), or DONE with the call's ``name`` and ``arguments``.
Each answer depends on the text alone, never on where a delta ended.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Any, Protocol

from tidal.app.tool_parsers.calls import CallSyntax, JsonCall, NamedCall
from tidal.app.tool_parsers.json_scan import JsonScanner
from tidal.app.tool_parsers.xml_parameters import CLOSE, OPEN, arguments_json


class Read(Enum):
    MORE = "more"  # the text so far does not tell yet
    BROKEN = "broken"  # not a call
    DONE = "done"


Step = tuple[Read, int]
REPLACEMENT = "\ufffd"


class CallReader(Protocol):
    name: str
    arguments: str  # a JSON object's text

    def advance(self, text: str, pos: int) -> Step: ...


def reader_for(syntax: CallSyntax, schemas: dict[str, dict[str, Any]]) -> CallReader:
    """A reader for one call of ``syntax``; ``schemas`` (the tools' parameters by name) type
    the values of XML parameters."""
    if isinstance(syntax.call, NamedCall):
        return NamedCallReader(syntax.call, schemas)
    return JsonCallReader(syntax.call)


def skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def cut_short(text: str, pos: int, marker: str) -> bool:
    """Whether the text ends at ``pos`` with a proper prefix of ``marker``. Its last character
    may be U+FFFD where the marker's is not ASCII: the detokenizer's stand-in for a character
    the reply ended inside of (``<｜tool`` cut inside ``｜``)."""
    rest = text[pos:pos + len(marker)]
    if len(rest) >= len(marker):
        return False
    if rest.endswith(REPLACEMENT) and not marker[len(rest) - 1].isascii():
        rest = rest[:-1]
    return marker.startswith(rest)


def match_literal(text: str, pos: int, literal: str) -> Step:
    """``literal`` at ``pos``, any whitespace before each of its words (none included); MORE
    leaves ``pos`` where it was, so the literal is matched again from its start."""
    at = pos
    for word in literal.split():
        at = skip_space(text, at)
        if text.startswith(word, at):
            at += len(word)
        elif at == len(text) or cut_short(text, at, word):
            return Read.MORE, pos
        else:
            return Read.BROKEN, pos
    return Read.DONE, at


class ObjectReader:
    """Whitespace, then one JSON object; ``start`` is where it opened."""

    def __init__(self) -> None:
        self.scanner: JsonScanner | None = None
        self.start = 0

    def advance(self, text: str, pos: int) -> Step:
        if self.scanner is None:
            pos = skip_space(text, pos)
            if pos == len(text):
                return Read.MORE, pos
            if text[pos] != "{":
                return Read.BROKEN, pos
            self.scanner, self.start = JsonScanner(), pos
        while pos < len(text):
            if not self.scanner.feed(text, pos):
                return Read.BROKEN, pos
            pos += 1
            if self.scanner.done:
                return Read.DONE, pos
        return Read.MORE, pos


class JsonCallReader:
    """``{"name": ..., "arguments": {...}}``, its members in any order."""

    def __init__(self, layout: JsonCall) -> None:
        self.keys = layout.argument_keys
        self.object = ObjectReader()
        self.name = ""
        self.arguments = ""

    def advance(self, text: str, pos: int) -> Step:
        status, pos = self.object.advance(text, pos)
        if status is Read.DONE and not self._take(text):
            return Read.BROKEN, pos
        return status, pos

    def _take(self, text: str) -> bool:
        """Whether the object names a function and holds an arguments object."""
        members = self.object.scanner.members
        span = members.get("name")
        name = json.loads(text[span[0]:span[1]]) if span else None
        arguments = next((members[k] for k in members if k in self.keys), None)
        if not isinstance(name, str) or not name or arguments is None \
                or text[arguments[0]] != "{":
            return False
        self.name, self.arguments = name, text[arguments[0]:arguments[1]]
        return True


class NamedCallReader:
    """``begin NAME name_end ARGUMENTS end`` (``NamedCall``)."""

    def __init__(self, layout: NamedCall, schemas: dict[str, dict[str, Any]]) -> None:
        self.layout = layout
        self.schemas = schemas
        self.phase = 0
        self.name = ""
        self.arguments = ""
        self._object = ObjectReader()
        self._parameters = ParametersReader()

    def advance(self, text: str, pos: int) -> Step:
        steps = (self._begin, self._name, self._name_end, self._arguments, self._end)
        while self.phase < len(steps):
            status, pos = steps[self.phase](text, pos)
            if status is not Read.DONE:
                return status, pos
            self.phase += 1
        return Read.DONE, pos

    def _begin(self, text: str, pos: int) -> Step:
        return match_literal(text, pos, self.layout.begin)

    def _name(self, text: str, pos: int) -> Step:
        """The text up to whitespace or the first character of ``name_end``."""
        stop = self.layout.name_end.split()[0][0]
        start = end = skip_space(text, pos)
        while end < len(text) and not text[end].isspace() and text[end] != stop:
            end += 1
        if end == len(text):
            return Read.MORE, pos
        if end == start:
            return Read.BROKEN, pos
        self.name = text[start:end]
        return Read.DONE, end

    def _name_end(self, text: str, pos: int) -> Step:
        return match_literal(text, pos, self.layout.name_end)

    def _arguments(self, text: str, pos: int) -> Step:
        if not self.layout.xml:
            status, end = self._object.advance(text, pos)
            if status is Read.DONE:
                self.arguments = text[self._object.start:end]
            return status, end
        status, end = self._parameters.advance(text, pos)
        if status is Read.DONE:
            self.arguments = arguments_json(self._parameters.parameters,
                                            self.schemas.get(self.name))
        return status, end

    def _end(self, text: str, pos: int) -> Step:
        return match_literal(text, pos, self.layout.end)


def _layout_stripped(value: str) -> str:
    """The value without the newline after its opening tag and the one before its closing."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


class ParametersReader:
    """Parameter blocks, whitespace around them, until what follows is not one: then DONE at
    the end of the last block (the caller matches ``</function>`` there)."""

    def __init__(self) -> None:
        self.parameters: list[tuple[str, str]] = []
        self._name = ""
        self._value_start: int | None = None
        self._searched = 0  # no CLOSE starts before here

    def advance(self, text: str, pos: int) -> Step:
        while True:
            if self._value_start is None:
                start = skip_space(text, pos)
                if start == len(text) or cut_short(text, start, OPEN):
                    return Read.MORE, pos
                if not text.startswith(OPEN, start):
                    return Read.DONE, pos
                status, end = self._open(text, start + len(OPEN))
                if status is not Read.DONE:
                    return status, pos
                pos = self._value_start = self._searched = end
            end = text.find(CLOSE, self._searched)
            if end < 0:
                self._searched = max(self._value_start, len(text) - len(CLOSE) + 1)
                return Read.MORE, pos
            value = _layout_stripped(text[self._value_start:end])
            self.parameters.append((self._name, value))
            self._value_start, pos = None, end + len(CLOSE)

    def _open(self, text: str, start: int) -> Step:
        """The parameter's name, up to ``>``: no whitespace or ``<`` in it."""
        end = start
        while end < len(text) and text[end] != ">":
            if text[end].isspace() or text[end] == "<":
                return Read.BROKEN, start
            end += 1
        if end == len(text):
            return Read.MORE, start
        if end == start:
            return Read.BROKEN, start
        self._name = text[start:end]
        return Read.DONE, end + 1
