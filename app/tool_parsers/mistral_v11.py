"""Mistral with v11 and later tokenizers (Mistral Small 3.2, Devstral, Magistral):
``[TOOL_CALLS]NAME[ARGS]{...}``, a ``[TOOL_CALLS]`` before each call.

A parser of its own rather than a second form read by ``mistral``: the two forms need
different grammars, and a server takes one format from its chat template (``[ARGS]`` in it
names this one) or from ``--tool-call-parser``; keeping them apart keeps each syntax a single
one, as every other format's is."""

from __future__ import annotations

from typing import Any

from tidal.app.tool_parsers.base import ToolParser, json_schema_format
from tidal.app.tool_parsers.calls import CallSyntax, NamedCall, Trigger


class MistralV11ToolParser(ToolParser):
    name = "mistral_v11"
    trigger = "[TOOL_CALLS]"
    separator = ""
    special_markers = True
    syntax = CallSyntax(triggers=(Trigger("[TOOL_CALLS]"),),
                        call=NamedCall(begin="", name_end="[ARGS]", end=""),
                        markup=("[ARGS]",))

    def call_tag(self, name: str, schema: dict[str, Any]) -> dict[str, Any]:
        return {"type": "tag", "begin": f"[TOOL_CALLS]{name}[ARGS]",
                "content": json_schema_format(schema), "end": ""}
