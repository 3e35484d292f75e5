"""gpt-oss (OpenAI's Harmony format, vLLM's ``openai`` parser): each call is a commentary
message to ``functions.NAME``, its arguments a JSON object::

    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>
    {...}<|call|>

The parser reads the answer the ``gpt_oss`` reasoning splitter leaves (``app/harmony.py``),
which writes every call message in that one layout (whatever order the model wrote its header
in); ``<|call|>``, a stop token, is usually not in the text. The grammar, in contrast, holds
the model's own reply: the final message's text, or call messages, each after the next
message's ``<|start|>assistant`` (the prompt wrote the first one's).
"""

from __future__ import annotations

from typing import Any

from tidal.app.harmony import (
    CALL,
    CALL_ARGUMENTS,
    CALL_HEADER,
    CHANNEL,
    CONSTRAIN,
    FINAL_HEADER,
    FUNCTIONS,
    MESSAGE,
    NEXT_MESSAGE,
    text_excludes,
)
from tidal.app.tool_parsers.base import ToolParser, json_schema_format
from tidal.app.tool_parsers.calls import CallSyntax, NamedCall, Trigger


class OpenAIToolParser(ToolParser):
    name = "openai"
    trigger = CALL_HEADER
    separator = CALL + NEXT_MESSAGE  # between calls (a model stops at <|call|> in practice)
    special_markers = True
    syntax = CallSyntax(triggers=(Trigger(CALL_HEADER),), closer=CALL,
                        call=NamedCall(begin="", name_end=CALL_ARGUMENTS.strip(), end=""),
                        markup=(CONSTRAIN, MESSAGE))

    def call_tag(self, name: str, schema: dict[str, Any]) -> dict[str, Any]:
        """One call message as the model writes it, from its channel on; it ends with its
        arguments (``<|call|>`` is a stop token, which ends the reply)."""
        return {"type": "tag",
                "begin": f"{CHANNEL}commentary to={FUNCTIONS}{name}{CALL_ARGUMENTS}",
                "content": json_schema_format(schema), "end": ""}

    def auto_format(self, tags: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
        """The final message's free text, or calls only."""
        text = {"type": "sequence", "elements": [
            {"type": "const_string", "value": FINAL_HEADER},
            {"type": "any_text", "excludes": text_excludes()}]}
        return {"type": "or", "elements": [text, self.forced_format(tags, parallel)]}
