"""A reply's text as the Responses API's output items and stream events.

``ResponseBuilder`` is fed the reply's text deltas as the engine produces them. The chat
endpoint's ``ReplyDeltas`` (``app/chat_reply.py``) divides the text; the builder turns each
piece into the items it belongs to, in the order they appear: a ``reasoning`` item for the
thinking, a ``message`` item with an ``output_text`` part for the answer, a
``function_call`` item for each call (sent whole, as the streamer finds it). A streamed
response sends its events; a whole one is fed the same deltas and keeps only the items, so the
two hold the same output.

Events follow OpenAI's order, each with its ``sequence_number``: ``response.created``,
``response.in_progress``, then per item ``output_item.added``, ``content_part.added``, the
text deltas and their ``.done``, ``content_part.done``, ``output_item.done`` (a function call:
``function_call_arguments.delta`` and ``.done`` in between), and last ``response.completed``
(``response.incomplete`` for a reply cut by ``max_output_tokens``, ``response.failed`` for one
that failed).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from tidal.app.chat_reply import ReplyDeltas
from tidal.app.responses_request import PreparedResponse

Event = dict[str, Any]
# an open item's kind -> its content part's type and the prefix of its text events
PARTS = {"message": ("output_text", "response.output_text"),
         "reasoning": ("reasoning_text", "response.reasoning_text")}
ID_PREFIXES = {"message": "msg", "reasoning": "rs", "function_call": "fc"}


def new_item_id(kind: str) -> str:
    return f"{ID_PREFIXES[kind]}_{uuid.uuid4().hex}"


def content_part(kind: str, text: str) -> dict[str, Any]:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": PARTS[kind][0], "text": text}


def text_item(kind: str, item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """A ``message`` or ``reasoning`` item; ``text`` None: no content part yet."""
    parts = [] if text is None else [content_part(kind, text)]
    if kind == "message":
        return {"id": item_id, "type": "message", "role": "assistant", "status": status,
                "content": parts}
    return {"id": item_id, "type": "reasoning", "summary": [], "content": parts,
            "status": status}


def function_call_item(call: dict[str, Any], item_id: str, arguments: str, status: str
                       ) -> dict[str, Any]:
    """A call as the tool-call streamer gives it (chat delta shape) as a Responses item."""
    return {"id": item_id, "type": "function_call", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": arguments, "status": status}


def response_usage(input_tokens: int, output_tokens: int, cached_tokens: int,
                   reasoning_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


def response_object(prep: PreparedResponse, status: str, output: list[dict[str, Any]],
                    usage: dict[str, Any] | None = None, error: dict[str, Any] | None = None
                    ) -> dict[str, Any]:
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {"id": prep.id, "object": "response", "created_at": prep.created_at,
            "status": status, "model": prep.chat.model, "output": output, "error": error,
            "incomplete_details": incomplete, "usage": usage, **prep.echo}


@dataclass
class _OpenItem:
    kind: str  # "message" or "reasoning"
    index: int  # its output_index
    id: str
    text: str = ""


@dataclass
class ResponseBuilder:
    """One response's output items and events, fed its reply's text deltas."""

    prep: PreparedResponse
    items: list[dict[str, Any]] = field(default_factory=list)  # finished, by output_index
    sequence: int = 0
    reasoning: str = ""  # all the thinking, for usage's reasoning_tokens
    output_tokens: int = 0  # counted by the caller, for usage
    cached_tokens: int = 0
    finish_reason: str | None = None
    _open: _OpenItem | None = None

    def __post_init__(self) -> None:
        chat = self.prep.chat
        self._reply = ReplyDeltas(chat.tool_use, chat.reasoning)

    @property
    def status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"

    def start(self) -> list[Event]:
        return [self._event(kind, response=response_object(self.prep, "in_progress", []))
                for kind in ("response.created", "response.in_progress")]

    def feed(self, text: str, finish_reason: str | None = None) -> list[Event]:
        """The events of one delta of the reply; ``finish_reason`` on its last."""
        delta, _ = self._reply.feed(text, finish_reason)
        events = self._text("reasoning", delta["reasoning_content"]) \
            if "reasoning_content" in delta else []
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls", []):
            events += self._call(call)
        if finish_reason is not None:
            self.finish_reason = finish_reason
            events += self._close()
        return events

    def finish(self, usage: dict[str, Any]) -> list[Event]:
        """The last events: an empty message where the reply had no answer and no call, then
        ``response.completed`` (or ``response.incomplete``)."""
        events = self._close()
        if not any(item["type"] in ("message", "function_call") for item in self.items):
            events += self._open_text("message") + self._close()
        kind = "response.incomplete" if self.status == "incomplete" else "response.completed"
        return events + [self._event(kind, response=self.response(usage))]

    def failed(self, message: str, usage: dict[str, Any] | None = None) -> Event:
        error = {"code": "server_error", "message": message}
        return self._event("response.failed", response=response_object(
            self.prep, "failed", list(self.items), usage, error))

    def response(self, usage: dict[str, Any]) -> dict[str, Any]:
        return response_object(self.prep, self.status, list(self.items), usage)

    # -- items -----------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _text(self, kind: str, text: str) -> list[Event]:
        events = [] if self._open is not None and self._open.kind == kind else \
            self._close() + self._open_text(kind)
        item = self._open
        item.text += text
        if kind == "reasoning":
            self.reasoning += text
        extra = {"logprobs": []} if kind == "message" else {}
        return events + [self._event(PARTS[kind][1] + ".delta", item_id=item.id,
                                     output_index=item.index, content_index=0, delta=text,
                                     **extra)]

    def _open_text(self, kind: str) -> list[Event]:
        item = self._open = _OpenItem(kind, len(self.items), new_item_id(kind))
        where = {"item_id": item.id, "output_index": item.index}
        return [self._event("response.output_item.added", output_index=item.index,
                            item=text_item(kind, item.id, None, "in_progress")),
                self._event("response.content_part.added", **where, content_index=0,
                            part=content_part(kind, ""))]

    def _close(self) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        status = "incomplete" if self.finish_reason == "length" else "completed"
        where = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        extra = {"logprobs": []} if item.kind == "message" else {}
        done = text_item(item.kind, item.id, item.text, status)
        self.items.append(done)
        return [self._event(PARTS[item.kind][1] + ".done", **where, text=item.text, **extra),
                self._event("response.content_part.done", **where,
                            part=content_part(item.kind, item.text)),
                self._event("response.output_item.done", output_index=item.index, item=done)]

    def _call(self, call: dict[str, Any]) -> list[Event]:
        events = self._close()
        index, item_id = len(self.items), new_item_id("function_call")
        arguments = call["function"]["arguments"]
        done = function_call_item(call, item_id, arguments, "completed")
        self.items.append(done)
        where = {"item_id": item_id, "output_index": index}
        return events + [
            self._event("response.output_item.added", output_index=index,
                        item=function_call_item(call, item_id, "", "in_progress")),
            self._event("response.function_call_arguments.delta", **where, delta=arguments),
            self._event("response.function_call_arguments.done", **where,
                        arguments=arguments, name=done["name"]),
            self._event("response.output_item.done", output_index=index, item=done)]
