"""What a reply's tool calls parse into, and the syntax a format writes them in."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # the model's arguments object, exactly as generated

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedReply:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class StreamDelta:
    """One step of a streamed reply: ``tool_calls`` holds chat-completion-chunk delta items."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Trigger:
    """Text that opens a call; ``keep`` marks triggers that are the call object's own start
    (Llama's ``{"name"``), so parsing the object begins at the trigger itself."""

    text: str
    keep: bool = False


@dataclass(frozen=True)
class JsonCall:
    """A call written as one JSON object: ``{"name": ..., "arguments": {...}}``, the arguments
    under the first of ``argument_keys`` present."""

    argument_keys: tuple[str, ...] = ("arguments", "parameters")


@dataclass(frozen=True)
class NamedCall:
    """A call written as ``begin NAME name_end ARGUMENTS end``: the function's name as bare
    text, then its arguments as a JSON object, or (``xml``) as Qwen3-Coder's
    ``<parameter=P>`` blocks. Read leniently: any whitespace may come before each word of
    ``begin``, ``name_end`` and ``end`` (their own whitespace is thus optional); the name is
    the text up to whitespace or ``name_end``."""

    begin: str
    name_end: str
    end: str
    xml: bool = False


@dataclass(frozen=True)
class CallList:
    """Calls written as one list after the trigger: ``opener``, the calls with ``separator``
    between them (whitespace only where it is empty), then ``closer``."""

    opener: str = ""
    separator: str = ""
    closer: str = ""


@dataclass(frozen=True)
class CallSyntax:
    """How a format writes its calls: a trigger, then one call (``call``) and ``closer``, or a
    ``listed`` run of calls. After a call, whitespace and ``separators`` are not content.
    ``markup`` names the format's other markers, which are never content either."""

    triggers: tuple[Trigger, ...]
    call: JsonCall | NamedCall = JsonCall()
    closer: str = ""
    listed: CallList | None = None
    separators: str = ""
    markup: tuple[str, ...] = ()

    def is_separator(self, char: str) -> bool:
        return char.isspace() or char in self.separators

    def markers(self) -> list[str]:
        """Every marker of the format's calls: its triggers, its closer and its markup."""
        found = [t.text for t in self.triggers] + [self.closer, *self.markup]
        return [m for m in dict.fromkeys(found) if m]
