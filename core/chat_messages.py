"""A chat message's content as the text a chat template renders."""

from __future__ import annotations

from typing import Any


def content_text(content: Any) -> str:
    """A message's ``content``: a string, ``None`` (an assistant turn with no text) or
    OpenAI's list of ``{"type": "text", "text": ...}`` parts, joined by newlines. Raises
    ``ValueError`` for any other part (only text is supported)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ValueError("content must be a string or a list of text content parts")
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" \
                or not isinstance(part.get("text"), str):
            raise ValueError(f"content part {i} must be {{\"type\": \"text\", \"text\": "
                             "<string>}} (only text content is supported)")
    return "\n".join(part["text"] for part in content)
