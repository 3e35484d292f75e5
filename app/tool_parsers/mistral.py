"""Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, one list for all the
reply's calls."""

from __future__ import annotations

import json
from typing import Any

from tidal.app.tool_parsers.base import ToolParser, calls_format, json_schema_format
from tidal.app.tool_parsers.calls import CallSyntax, Trigger


class MistralToolParser(ToolParser):
    name = "mistral"
    trigger = "[TOOL_CALLS]"
    separator = ", "
    syntax = CallSyntax(triggers=(Trigger("[TOOL_CALLS]"),), in_list=True)

    def call_tag(self, name: str, schema: dict[str, Any]) -> dict[str, Any]:
        return {"type": "tag", "begin": f'{{"name": {json.dumps(name)}, "arguments": ',
                "content": json_schema_format(schema), "end": "}"}

    def auto_format(self, tags: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
        """Free text, then at most one list of calls, which ends the reply."""
        return {"type": "triggered_tags", "triggers": [self.trigger],
                "tags": [self.forced_format(tags, parallel)],
                "at_least_one": False, "stop_after_first": True,
                "excludes": self.text_excludes()}

    def forced_format(self, tags: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
        return {"type": "tag", "begin": "[TOOL_CALLS][",
                "content": calls_format(tags, self.separator, parallel), "end": "]"}
