"""A character-at-a-time JSON object validator that records where the object's top-level
members' values lie, so a call's arguments can be streamed as they are generated and cut
out of the text exactly."""

from __future__ import annotations

import json
import re
from enum import Enum

_WHITESPACE = " \t\n\r"
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_LITERALS = ("true", "false", "null")
_ESCAPES = frozenset('"\\/bfnrtu')
_HEX = frozenset("0123456789abcdefABCDEF")


class _Expect(Enum):
    VALUE = "value"
    VALUE_OR_CLOSE = "value or ]"
    KEY = "key"
    KEY_OR_CLOSE = "key or }"
    COLON = ":"
    COMMA_OR_CLOSE = ", or close"


class JsonScanner:
    """Feed an object's characters one position of ``text`` at a time; ``feed`` returns
    False at the first character no JSON object can continue with. ``members`` maps each
    top-level key (its first occurrence) to its value's ``[start, end)`` in ``text``, ``end``
    None while the value is open."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.expect = _Expect.VALUE
        self.done = False
        self.members: dict[str, list[int | None]] = {}
        self._key: str | None = None
        self._recording = False
        self._string_start: int | None = None
        self._string_is_key = False
        self._escape = 0  # 0: none; 1: after a backslash; 2-5: hex digits of \u left + 1
        self._token = ""  # a number or literal in progress

    def feed(self, text: str, index: int) -> bool:
        char = text[index]
        if self.done:
            return False
        if self._string_start is not None:
            return self._string_char(text, index)
        if self._token:
            if self._token[0] in "-0123456789":
                if char in _NUMBER_CHARS:
                    self._token += char
                    return True
                if not _NUMBER.fullmatch(self._token):
                    return False
                self._token = ""
                self._end_value(index)
            else:
                return self._literal_char(char, index)
        if char in _WHITESPACE:
            return True
        return self._structural(char, index)

    def _structural(self, char: str, index: int) -> bool:
        expect = self.expect
        if expect in (_Expect.VALUE, _Expect.VALUE_OR_CLOSE):
            if char == "]" and expect is _Expect.VALUE_OR_CLOSE:
                return self._close("[", index)
            return self._begin_value(char, index)
        if expect in (_Expect.KEY, _Expect.KEY_OR_CLOSE):
            if char == "}" and expect is _Expect.KEY_OR_CLOSE:
                return self._close("{", index)
            if char != '"':
                return False
            self._string_start, self._string_is_key = index, True
            return True
        if expect is _Expect.COLON:
            self.expect = _Expect.VALUE
            return char == ":"
        if char == ",":
            self.expect = _Expect.KEY if self.stack[-1] == "{" else _Expect.VALUE
            return True
        return char in "}]" and self._close("{" if char == "}" else "[", index)

    def _begin_value(self, char: str, index: int) -> bool:
        if not self.stack and char != "{":
            return False
        if len(self.stack) == 1:
            self._recording = self._key is not None and self._key not in self.members
            if self._recording:
                self.members[self._key] = [index, None]
        if char in "{[":
            self.stack.append(char)
            self.expect = _Expect.KEY_OR_CLOSE if char == "{" else _Expect.VALUE_OR_CLOSE
        elif char == '"':
            self._string_start, self._string_is_key = index, False
        elif char == "-" or char in "tfn" or char.isdigit() and char.isascii():
            self._token = char
        else:
            return False
        return True

    def _close(self, opener: str, index: int) -> bool:
        if not self.stack or self.stack[-1] != opener:
            return False
        self.stack.pop()
        self._end_value(index + 1)
        return True

    def _end_value(self, end: int) -> None:
        if not self.stack:
            self.done = True
            return
        if len(self.stack) == 1 and self._recording:
            self.members[self._key][1] = end
            self._recording = False
        self.expect = _Expect.COMMA_OR_CLOSE

    def _literal_char(self, char: str, index: int) -> bool:
        self._token += char
        if not any(word.startswith(self._token) for word in _LITERALS):
            return False
        if self._token in _LITERALS:
            self._token = ""
            self._end_value(index + 1)
        return True

    def _string_char(self, text: str, index: int) -> bool:
        char = text[index]
        if self._escape == 1:
            self._escape = 5 if char == "u" else 0
            return char in _ESCAPES
        if self._escape > 1:
            self._escape = self._escape - 1 if self._escape > 2 else 0
            return char in _HEX
        if char == "\\":
            self._escape = 1
        elif char == '"':
            self._end_string(text, index)
        elif ord(char) < 0x20:
            return False
        return True

    def _end_string(self, text: str, index: int) -> None:
        start, self._string_start = self._string_start, None
        if not self._string_is_key:
            self._end_value(index + 1)
            return
        self.expect = _Expect.COLON
        if len(self.stack) == 1:
            self._key = json.loads(text[start:index + 1])
