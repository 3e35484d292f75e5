"""The Responses API's ``input`` as chat messages, the shape ``prepare_chat_request`` takes.

``input`` is a string (one user message) or a list of items:

- messages (``{"role", "content"}``, ``"type": "message"`` optional): role ``user``,
  ``system``, ``developer`` (a system message to the chat template) or ``assistant``; content a
  string or a list of ``input_text`` / ``output_text`` parts;
- ``function_call`` (``call_id``, ``name``, ``arguments``): the assistant's earlier call, joined
  to the assistant message right before it, as a chat template lays a turn's calls out;
- ``function_call_output`` (``call_id``, ``output``): a ``tool`` message answering that call;
- ``reasoning``: an earlier turn's thinking, which chat templates leave out of the prompt.

A response's own output items are input items too, so a stored response's output becomes the
conversation of its follow-up through these same rules.
"""

from __future__ import annotations

from typing import Any

from tidal.app.errors import bad_request

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text")


def input_messages(value: Any, param: str = "input") -> list[dict[str, Any]]:
    """The chat messages of ``input``; a 400 naming the item at fault otherwise."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise bad_request(f"{param} must be a string or a list of input items", param)
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            _add_call(messages, item, where)
        elif kind == "function_call_output":
            messages.append(_call_output(item, where))
        elif kind != "reasoning":
            raise bad_request(f"{where}.type: {kind!r} items are not supported; the types are "
                              "message, function_call, function_call_output and reasoning",
                              f"{where}.type")
    return messages


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}",
                          f"{where}.role")
    return {"role": ROLES[role], "content": _content(item.get("content"), f"{where}.content")}


def _content(content: Any, where: str) -> str | list[dict[str, str]]:
    """A string, or the text parts as chat ``{"type": "text"}`` parts (which the chat
    request joins)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise bad_request(f"{where}[{j}].type must be input_text or output_text (only text "
                              f"is supported), got {kind!r}", f"{where}[{j}].type")
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{j}].text must be a string", f"{where}[{j}].text")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _string(item: dict[str, Any], key: str, where: str, empty: bool = False) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not (value or empty):
        raise bad_request(f"{where}.{key} must be a {'' if empty else 'non-empty '}string",
                          f"{where}.{key}")
    return value


def _add_call(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    call = {"id": _string(item, "call_id", where), "type": "function",
            "function": {"name": _string(item, "name", where),
                         "arguments": _string(item, "arguments", where, empty=True)}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _call_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": _string(item, "call_id", where),
            "content": _content(item.get("output"), f"{where}.output")}
