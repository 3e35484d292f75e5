"""Llama 3.1/3.2 JSON tool calls: ``{"name": ..., "parameters": {...}}``, possibly after
``<|python_tag|>``, several separated by ``; ``."""

from __future__ import annotations

import json
from typing import Any

from tidal.app.tool_parsers.base import ToolParser, json_schema_format
from tidal.app.tool_parsers.calls import CallSyntax, Trigger


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    trigger = '{"name": '
    separator = "; "
    syntax = CallSyntax(triggers=(Trigger("<|python_tag|>"), Trigger('{"name"', keep=True)),
                        separators=";")

    def call_tag(self, name: str, schema: dict[str, Any]) -> dict[str, Any]:
        return {"type": "tag", "begin": f'{{"name": {json.dumps(name)}, "parameters": ',
                "content": json_schema_format(schema), "end": "}"}
