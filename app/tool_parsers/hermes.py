"""Hermes and Qwen 2.5/3: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
one block per call, after any text."""

from __future__ import annotations

import json
from typing import Any

from tidal.app.tool_parsers.base import ToolParser, json_schema_format
from tidal.app.tool_parsers.calls import CallSyntax, Trigger


class HermesToolParser(ToolParser):
    name = "hermes"
    trigger = "<tool_call>"
    separator = "\n"
    syntax = CallSyntax(triggers=(Trigger("<tool_call>"),), closer="</tool_call>")

    def call_tag(self, name: str, schema: dict[str, Any]) -> dict[str, Any]:
        return {"type": "tag", "begin": f'<tool_call>\n{{"name": {json.dumps(name)}, '
                                        f'"arguments": ',
                "content": json_schema_format(schema), "end": "}\n</tool_call>"}
