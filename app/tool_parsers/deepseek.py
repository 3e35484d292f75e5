"""DeepSeek's tool calls, all the reply's calls in one block:

- ``deepseek_v3`` (V3, R1): ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>
  NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``, a newline between calls, then
  ``<｜tool▁calls▁end｜>``;
- ``deepseek_v31`` (V3.1): ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
  <｜tool▁call▁end｜>``, calls back to back, then ``<｜tool▁calls▁end｜>``.
"""

from __future__ import annotations

from typing import Any

from tidal.app.tool_parsers.base import ToolParser, json_schema_format
from tidal.app.tool_parsers.calls import CallList, CallSyntax, NamedCall, Trigger

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
MARKUP = (CALL_BEGIN, SEP, CALL_END, CALLS_END)


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    trigger = CALLS_BEGIN
    separator = "\n"
    special_markers = True
    syntax = CallSyntax(triggers=(Trigger(CALLS_BEGIN),), listed=CallList(closer=CALLS_END),
                        call=NamedCall(begin=f"{CALL_BEGIN}function{SEP}",
                                       name_end="\n```json\n", end=f"\n```{CALL_END}"),
                        markup=MARKUP)

    def call_tag(self, name: str, schema: dict[str, Any]) -> dict[str, Any]:
        return {"type": "tag", "begin": f"{CALL_BEGIN}function{SEP}{name}\n```json\n",
                "content": json_schema_format(schema), "end": f"\n```{CALL_END}"}


class DeepSeekV31ToolParser(ToolParser):
    name = "deepseek_v31"
    trigger = CALLS_BEGIN
    separator = ""
    special_markers = True
    syntax = CallSyntax(triggers=(Trigger(CALLS_BEGIN),), listed=CallList(closer=CALLS_END),
                        call=NamedCall(begin=CALL_BEGIN, name_end=SEP, end=CALL_END),
                        markup=MARKUP)

    def call_tag(self, name: str, schema: dict[str, Any]) -> dict[str, Any]:
        return {"type": "tag", "begin": f"{CALL_BEGIN}{name}{SEP}",
                "content": json_schema_format(schema), "end": CALL_END}
