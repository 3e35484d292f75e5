"""OpenAI's Harmony chat format (gpt-oss): a reply split into its messages, the thinking
(``analysis`` channel) apart from the answer (``final`` channel) and the tool calls (a
recipient ``to=functions.NAME``).

A reply follows a prompt that ends with ``<|start|>assistant``, so its first message starts at
its header::

    <|channel|>analysis<|message|>THINKING<|end|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>
    {ARGUMENTS}<|call|>

(the recipient may also stand in the role part: ``<|start|>assistant to=functions.NAME
<|channel|>commentary json<|message|>``). ``<|return|>`` and ``<|call|>`` are stop tokens, so
the reply's text usually ends without them.

``HarmonySplitter`` reads the messages as the text arrives, like ``ReasoningSplitter`` (one
state machine, every decision made on the text alone, so a stream and the whole reply agree):
the analysis bodies are the reasoning, the final (and recipient-less commentary) bodies the
content. A call message (``calls``: the request offered tools) goes to the content in one
canonical layout, ``CALL_HEADER`` NAME ``<|constrain|>json<|message|>`` ARGUMENTS, which the
``openai`` tool parser reads (``tool_parsers/openai.py``), once the message has ended and only
where its arguments are a JSON object; a call cut short or malformed, a call without tools, and
messages to other recipients (built-in tools, which this server does not offer) are dropped.
No Harmony token ever reaches the content or the reasoning.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any

START, END, RETURN, CALL = "<|start|>", "<|end|>", "<|return|>", "<|call|>"
CHANNEL, MESSAGE, CONSTRAIN = "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = (END, RETURN, CALL)  # close a message
OPENS = (START, CHANNEL)  # a further message's header, where the model wrote no end
TOKENS = (*ENDS, *OPENS, MESSAGE, CONSTRAIN, "<|endoftext|>", "<|startoftext|>")
ANALYSIS_HEADER = f"{CHANNEL}analysis{MESSAGE}"
FINAL_HEADER = f"{CHANNEL}final{MESSAGE}"
NEXT_MESSAGE = f"{START}assistant"
FUNCTIONS = "functions."
CALL_HEADER = f"{NEXT_MESSAGE}{CHANNEL}commentary to={FUNCTIONS}"
CALL_ARGUMENTS = f" {CONSTRAIN}json{MESSAGE}"

_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")


class Part(Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    CALL = "call"
    DROPPED = "dropped"


@dataclass(frozen=True)
class Header:
    """A message's header: the text between its start and ``<|message|>``."""

    channel: str
    recipient: str

    @classmethod
    def parse(cls, text: str) -> Header:
        channel, recipient = _CHANNEL.search(text), _RECIPIENT.search(text)
        return cls(channel.group(1) if channel else "", recipient.group(1) if recipient else "")

    def part(self) -> Part:
        if self.recipient.startswith(FUNCTIONS) and len(self.recipient) > len(FUNCTIONS):
            return Part.CALL
        if self.recipient:
            return Part.DROPPED
        return Part.REASONING if self.channel == "analysis" else Part.CONTENT


class _State(Enum):
    OPENING = "opening"  # whether the reply starts with a header is not yet known
    HEADER = "header"
    BODY = "body"


@dataclass
class HarmonyDelta:
    """The same shape as ``reasoning.ReasoningDelta``."""

    reasoning: str = ""
    content: str = ""


class HarmonySplitter:
    """One Harmony reply's reasoning and content, fed as it arrives. ``closed``: the prompt
    already opened the final message, so the reply is its body."""

    def __init__(self, closed: bool = False, calls: bool = False) -> None:
        self.text = ""
        self.pos = 0
        self.final = False
        self.calls = calls
        self.state = _State.BODY if closed else _State.OPENING
        self.part = Part.CONTENT
        self.call_name = ""
        self.call_body = ""  # a call message's body, sent once the message has ended

    def feed(self, text: str) -> HarmonyDelta:
        self.text += text
        return self._run()

    def finish(self) -> HarmonyDelta:
        self.final = True
        return self._run()

    def _run(self) -> HarmonyDelta:
        delta = HarmonyDelta()
        steps = {_State.OPENING: self._opening, _State.HEADER: self._header,
                 _State.BODY: self._body}
        while steps[self.state](delta):
            pass
        return delta

    def _emit(self, delta: HarmonyDelta, text: str) -> None:
        if self.part is Part.REASONING:
            delta.reasoning += text
        elif self.part is Part.CONTENT:
            delta.content += text
        elif self.part is Part.CALL:
            self.call_body += text

    def _end_message(self, delta: HarmonyDelta) -> None:
        """A call message's canonical text, where its body is a JSON object."""
        if self.part is Part.CALL and self.calls and _is_object(self.call_body):
            delta.content += f"{CALL_HEADER}{self.call_name}{CALL_ARGUMENTS}" \
                f"{self.call_body.strip()}"
        self.part, self.call_body = Part.DROPPED, ""

    # Each step returns False when it needs more text than has arrived.

    def _opening(self, delta: HarmonyDelta) -> bool:
        """A reply that does not open with a header (a model that writes no Harmony) is all
        answer."""
        head = self.text[self.pos:].lstrip()
        if head.startswith(("<|", "to=")):
            self.state = _State.HEADER
        elif not self.final and ("<|".startswith(head) or "to=".startswith(head)):
            return False
        else:
            self.state = _State.BODY
        return True

    def _header(self, delta: HarmonyDelta) -> bool:
        """Up to ``<|message|>``; a header the reply ends inside is dropped."""
        end = self.text.find(MESSAGE, self.pos)
        if end < 0:
            if self.final:
                self.pos = len(self.text)
            return False
        header = Header.parse(self.text[self.pos:end])
        self.pos, self.state, self.part = end + len(MESSAGE), _State.BODY, header.part()
        self.call_name = header.recipient[len(FUNCTIONS):]
        return True

    def _body(self, delta: HarmonyDelta) -> bool:
        """Up to the next Harmony token, or up to what may still become one."""
        found = [(self.text.find(t, self.pos), t) for t in TOKENS]
        found = [(at, t) for at, t in found if at >= 0]
        if found:
            at, token = min(found)
            self._emit(delta, self.text[self.pos:at])
            self.pos = at if token in OPENS else at + len(token)
            if token in OPENS or token in ENDS:
                self._end_message(delta)
                self.state = _State.HEADER
            return True
        stop = len(self.text)
        if not self.final:
            stop = _held_back(self.text, self.pos)
        self._emit(delta, self.text[self.pos:stop])
        self.pos = stop
        if self.final:
            self._end_message(delta)
        return False


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _held_back(text: str, pos: int) -> int:
    """Where a possible start of a Harmony token at the end of ``text`` begins."""
    longest = max(len(t) for t in TOKENS) - 1
    for keep in range(min(longest, len(text) - pos), 0, -1):
        if any(t.startswith(text[len(text) - keep:]) for t in TOKENS):
            return len(text) - keep
    return len(text)


def harmony_thinking(closed: bool) -> dict[str, Any] | None:
    """The reply's analysis message as a format of xgrammar's structural tag, and the start
    of the next message (optional: the model may answer at once); None where the prompt
    opened the final message. Its text holds no other Harmony token, so the first ``<|end|>``
    ends it, as the splitter reads it."""
    if closed:
        return None
    text = {"type": "any_text", "excludes": [t for t in TOKENS if t != END]}
    block = {"type": "tag", "begin": ANALYSIS_HEADER, "content": text, "end": END}
    return {"type": "optional", "content": {"type": "sequence", "elements": [
        block, {"type": "const_string", "value": NEXT_MESSAGE}]}}


def final_format(answer: dict[str, Any]) -> dict[str, Any]:
    """``answer`` as the body of the final message."""
    return {"type": "sequence",
            "elements": [{"type": "const_string", "value": FINAL_HEADER}, answer]}


def text_excludes() -> list[str]:
    """The Harmony tokens free text in a final message may not write."""
    return list(TOKENS)
