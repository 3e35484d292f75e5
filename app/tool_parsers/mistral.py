"""Mistral before its v11 tokenizers: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``,
one list for all the reply's calls. The v11 form, a ``[TOOL_CALLS]`` per call, is
``mistral_v11.py``'s."""

from __future__ import annotations

import json
from typing import Any

from tidal.app.tool_parsers.base import ToolParser, json_schema_format
from tidal.app.tool_parsers.calls import CallList, CallSyntax, Trigger


class MistralToolParser(ToolParser):
    name = "mistral"
    trigger = "[TOOL_CALLS]"
    separator = ", "
    special_markers = True
    syntax = CallSyntax(triggers=(Trigger("[TOOL_CALLS]"),),
                        listed=CallList(opener="[", separator=",", closer="]"))

    def call_tag(self, name: str, schema: dict[str, Any]) -> dict[str, Any]:
        return {"type": "tag", "begin": f'{{"name": {json.dumps(name)}, "arguments": ',
                "content": json_schema_format(schema), "end": "}"}
