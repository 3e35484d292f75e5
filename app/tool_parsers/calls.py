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
class CallSyntax:
    """How a format writes its calls: a trigger, then one JSON object per call
    (``{"name": ..., "arguments": {...}}``), or a list of them for ``in_list``, then
    ``closer``. After a call, whitespace and ``separators`` are not content."""

    triggers: tuple[Trigger, ...]
    closer: str = ""
    in_list: bool = False
    separators: str = ""
    argument_keys: tuple[str, ...] = ("arguments", "parameters")

    def is_separator(self, char: str) -> bool:
        return char.isspace() or char in self.separators
