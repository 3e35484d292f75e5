"""A chat reply's parts: its thinking (``reasoning_content``), its text (``content``) and its
tool calls, split the same way whether the reply streams as deltas (``ReplyDeltas``: the SSE
chat and the websocket chat) or arrives whole (``whole_message``)."""

from __future__ import annotations

from typing import Any

from tidal.app.reasoning import FORMATS, ReasoningFormat, split_reasoning, splitter_for
from tidal.app.structured import ToolUse


def finish_reason(reason: str | None, called: bool) -> str | None:
    """``"tool_calls"`` for a reply that stopped after calling tools."""
    return "tool_calls" if called and reason == "stop" else reason


def messages_format(tool_use: ToolUse | None, reasoning: ReasoningFormat | None
                    ) -> tuple[ReasoningFormat | None, bool]:
    """The format the reply is split by, and whether its thinking is shown: the ``openai``
    tool parser reads Harmony calls out of the messages the ``gpt_oss`` splitter leaves, so
    without a reasoning parser the reply is still split, its thinking dropped."""
    if reasoning is None and tool_use is not None and tool_use.parser.name == "openai":
        return FORMATS["gpt_oss"], False
    return reasoning, True


class ReplyDeltas:
    """One choice's reply, fed as its text arrives: each piece as an OpenAI chat ``delta``
    (``reasoning_content``, ``content``, ``tool_calls`` fragments; only the parts it has)."""

    def __init__(self, tool_use: ToolUse | None, reasoning: ReasoningFormat | None) -> None:
        reasoning, self.shown = messages_format(tool_use, reasoning)
        self.thinker = splitter_for(reasoning, tool_use is not None) \
            if reasoning is not None else None
        self.streamer = tool_use.parser.streamer() if tool_use is not None else None

    def feed(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The delta of ``text``, and the finish reason to report (``reason`` is the
        engine's, set on the reply's last piece)."""
        reasoning = ""
        if self.thinker is not None:
            parts = [self.thinker.feed(text)] + ([self.thinker.finish()] if reason else [])
            text = "".join(p.content for p in parts)
            reasoning = "".join(p.reasoning for p in parts)
        delta: dict[str, Any] = {"content": text} if text else {}
        if self.streamer is not None:
            delta, reason = self._calls(text, reason)
        if reasoning and self.shown:
            delta = {"reasoning_content": reasoning, **delta}
        return delta, reason

    def _calls(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The answer's text split into content and ``tool_calls`` fragments."""
        assert self.streamer is not None
        parts = [self.streamer.feed(text)] if text else []
        if reason is not None:
            parts.append(self.streamer.finish(cut=reason == "length"))
        delta: dict[str, Any] = {}
        content = "".join(p.content for p in parts)
        calls = [c for p in parts for c in p.tool_calls]
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta, finish_reason(reason, bool(self.streamer.result().tool_calls))


def whole_message(tool_use: ToolUse | None, reasoning: ReasoningFormat | None, text: str,
                  reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A whole reply's ``message`` and the finish reason to report."""
    thinking: dict[str, Any] = {}
    reasoning, shown = messages_format(tool_use, reasoning)
    if reasoning is not None:
        thought, text = split_reasoning(reasoning, text, tool_use is not None)
        thinking = {"reasoning_content": thought} if shown else {}
    if tool_use is None:
        return {"role": "assistant", **thinking, "content": text}, reason
    reply = tool_use.parser.extract(text, cut=reason == "length")
    message: dict[str, Any] = {"role": "assistant", **thinking, "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = [call.to_openai() for call in reply.tool_calls]
    return message, finish_reason(reason, bool(reply.tool_calls))
