"""Splitting a reply into content and tool calls as its text arrives.

One state machine serves both ``extract`` and streaming, so the two agree on every text and
on every way of cutting it into deltas: every decision is made at a character position, with
the text up to a fixed distance past it, never on where a delta ended. Text that may still
turn out to be a trigger or another of the format's markers, and the whitespace before it, is
held back until it is known. Past a trigger, a call reader (``call_readers.py``) reads each
call in the format's own layout; a list format's calls follow one another to its closer.

A call is sent whole (id, name and arguments in one delta) once it is complete, so that a
stream and ``extract`` agree on every reply, a reply cut short included. Where the reply ends
inside a call (cut by ``max_tokens`` or a stop string), or right after a trigger, that
unfinished call is dropped: it is neither a call nor content, so no call markup ever reaches
the content; so is a marker's start at the end of a reply cut short. Text that breaks a call's
syntax (a model writing a trigger in free text) is content, from the trigger on.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any

from tidal.app.tool_parsers.call_readers import CallReader, Read, cut_short, reader_for
from tidal.app.tool_parsers.calls import (
    CallSyntax,
    ParsedReply,
    StreamDelta,
    ToolCall,
    Trigger,
    new_call_id,
)

_UNDECIDED = Trigger("")  # the text so far may still become a trigger, or a marker


class _State(Enum):
    TEXT = "text"
    BEFORE_LIST = "before list"  # after a list format's trigger: its opener ("[")
    IN_CALL = "in call"  # a call reader's
    AFTER_CALL = "after call"  # the closer, or the list's separator or closer


class CallSplitter:
    """Content and calls of one reply, fed as it arrives; ``schemas`` (the tools' parameters
    by name) type the values of formats whose arguments are not JSON."""

    def __init__(self, syntax: CallSyntax, schemas: dict[str, dict[str, Any]] | None = None
                 ) -> None:
        self.syntax = syntax
        self.schemas = schemas or {}
        self.markers = syntax.markers()
        self.text = ""
        self.pos = 0
        self.state = _State.TEXT
        self.final = False
        self.calls: list[ToolCall] = []
        self.content: list[str] = []
        self._held_ws: int | None = None  # held whitespace in text starts here
        self._skipping_separators = False  # right after a call
        self._region = 0  # where the current trigger starts
        self._region_ws = 0  # where the whitespace held before it starts
        self._region_calls = 0
        self._last_call_end = 0
        self._reader: CallReader | None = None  # the open call's
        self._delta = StreamDelta()
        self._marker_starts = frozenset(m[0] for m in self.markers)

    # -- driving ---------------------------------------------------------------------------

    def feed(self, text: str) -> StreamDelta:
        self.text += text
        self._run()
        return self._take()

    def finish(self, cut: bool = False) -> StreamDelta:
        """The rest once the reply has ended. In a reply ``cut`` short (by ``max_tokens``), a
        trailing start of a marker (``<tool_``) is markup that never came, and is dropped."""
        if (cut and self.state is _State.TEXT and self.pos < len(self.text)
                and self._trigger_at(self.pos) is _UNDECIDED):
            self.text, self._held_ws = self.text[:self.pos], None
        self.final = True
        self._run()
        if self._held_ws is not None:
            self._emit(self.text[self._held_ws:])
            self._held_ws = None
        return self._take()

    def result(self) -> ParsedReply:
        """Content None where there is none (or only whitespace beside calls)."""
        content = "".join(self.content)
        if not content or self.calls and not content.strip():
            return ParsedReply(None, list(self.calls))
        return ParsedReply(content, list(self.calls))

    def _run(self) -> None:
        steps = {_State.TEXT: self._text, _State.BEFORE_LIST: self._before_list,
                 _State.IN_CALL: self._in_call, _State.AFTER_CALL: self._after_call_step}
        while self.pos < len(self.text) or self.final and self.state is not _State.TEXT:
            if not steps[self.state]():
                break

    def _take(self) -> StreamDelta:
        delta, self._delta = self._delta, StreamDelta()
        return delta

    # -- output ----------------------------------------------------------------------------

    def _emit(self, text: str) -> None:
        if text:
            self.content.append(text)
            self._delta.content += text

    def _emit_call(self, call: ToolCall) -> None:
        self.calls.append(call)
        self._delta.tool_calls.append({"index": len(self.calls) - 1, **call.to_openai()})

    # -- states ----------------------------------------------------------------------------
    # Each step returns False when it needs more text than has arrived.

    def _text(self) -> bool:
        if self._skipping_separators:
            self._skip(self.syntax.is_separator)
            if self.pos == len(self.text):
                return False
            self._skipping_separators = False
        trigger = self._trigger_at(self.pos)
        if trigger is None:
            return self._plain_text()
        if trigger is _UNDECIDED:
            return False
        self._region, self._region_calls = self.pos, 0
        self._region_ws = self.pos if self._held_ws is None else self._held_ws
        self._held_ws = None
        self.pos += 0 if trigger.keep else len(trigger.text)
        listed = self.syntax.listed
        if listed is not None and listed.opener:
            self.state = _State.BEFORE_LIST
        else:
            self._open_call()
        return True

    def _trigger_at(self, pos: int) -> Trigger | None:
        """The trigger starting at ``pos``, None for none, ``_UNDECIDED`` while the text
        that would tell whether a trigger or another marker starts there has not arrived."""
        for trigger in self.syntax.triggers:
            if self.text.startswith(trigger.text, pos):
                return trigger
        if not self.final and any(cut_short(self.text, pos, m) for m in self.markers):
            return _UNDECIDED
        return None

    def _plain_text(self) -> bool:
        """Content up to the next character a marker may start with; whitespace before
        it is held back."""
        end = self.pos + 1
        while end < len(self.text) and self.text[end] not in self._marker_starts:
            end += 1
        chunk = self.text[self.pos:end]
        kept = chunk.rstrip()
        if kept:
            start = self.pos if self._held_ws is None else self._held_ws
            self._emit(self.text[start:self.pos + len(kept)])
            self._held_ws = None
        if len(kept) < len(chunk) and self._held_ws is None:
            self._held_ws = self.pos + len(kept)
        self.pos = end
        return True

    def _before_list(self) -> bool:
        if not self._skip(str.isspace):
            return self.final and self._cut()
        opener = self.syntax.listed.opener
        if self.text.startswith(opener, self.pos):
            self.pos += len(opener)
            self._open_call()
            return True
        if cut_short(self.text, self.pos, opener):
            return self.final and self._cut()
        return self._break()

    def _open_call(self) -> None:
        self._reader = reader_for(self.syntax, self.schemas)
        self.state = _State.IN_CALL

    def _in_call(self) -> bool:
        status, self.pos = self._reader.advance(self.text, self.pos)
        if status is Read.MORE:
            return self.final and self._cut()
        if status is Read.BROKEN:
            return self._break()
        self._emit_call(ToolCall(new_call_id(), self._reader.name, self._reader.arguments))
        self._reader = None
        self._region_calls += 1
        self._last_call_end = self.pos
        self.state = _State.AFTER_CALL
        return True

    def _after_call_step(self) -> bool:
        if not self._skip(str.isspace):
            return self.final and self._end_region(self.pos)
        listed = self.syntax.listed
        closer = self.syntax.closer if listed is None else listed.closer
        if closer and self.text.startswith(closer, self.pos):
            return self._end_region(self.pos + len(closer))
        if closer and cut_short(self.text, self.pos, closer):
            return self.final and self._end_region(len(self.text))
        if listed is not None and self.text.startswith(listed.separator, self.pos):
            self.pos += len(listed.separator)
            self._open_call()  # the next call (without a separator: or what breaks the list)
            return True
        return self._end_region(self.pos)

    def _break(self) -> bool:
        """What looked like a call isn't one: back to text, from its trigger's second
        character, or from the end of the region's last call."""
        self._reader = None
        self.state = _State.TEXT
        if self._region_calls:
            self.pos = self._last_call_end
            self._skipping_separators = True
            return True
        self._emit(self.text[self._region_ws:self._region + 1])
        self.pos = self._region + 1
        return True

    def _cut(self) -> bool:
        """The reply ended inside a call or right after a trigger: the unfinished call is
        dropped, with the whitespace before it; the region's finished calls stay."""
        self._reader = None
        self.pos = len(self.text)
        self.state = _State.TEXT
        return True

    def _end_region(self, pos: int) -> bool:
        self.pos = pos
        self.state = _State.TEXT
        self._skipping_separators = True
        return True

    def _skip(self, predicate: Callable[[str], bool]) -> bool:
        """Past the characters ``predicate`` holds for; False at the end of the text."""
        while self.pos < len(self.text) and predicate(self.text[self.pos]):
            self.pos += 1
        return self.pos < len(self.text)


class ToolCallStreamer:
    """A streamed reply's content and tool-call deltas, in OpenAI's chunk shape."""

    def __init__(self, syntax: CallSyntax, schemas: dict[str, dict[str, Any]] | None = None
                 ) -> None:
        self._splitter = CallSplitter(syntax, schemas)

    def feed(self, delta_text: str) -> StreamDelta:
        return self._splitter.feed(delta_text)

    def finish(self, cut: bool = False) -> StreamDelta:
        """The held-back rest, once the reply has ended (``cut``: by ``max_tokens``)."""
        return self._splitter.finish(cut)

    def result(self) -> ParsedReply:
        """The reply as streamed, with the streamed calls' ids."""
        return self._splitter.result()


def split_reply(syntax: CallSyntax, text: str, cut: bool = False,
                schemas: dict[str, dict[str, Any]] | None = None) -> ParsedReply:
    splitter = CallSplitter(syntax, schemas)
    splitter.feed(text)
    splitter.finish(cut)
    return splitter.result()
