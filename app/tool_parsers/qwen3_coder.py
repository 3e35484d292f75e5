"""Qwen3-Coder (and Qwen3.5): ``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n
</parameter>\\n...</function>\\n</tool_call>``, one block per call, each value raw text typed
by its parameter's schema (``xml_parameters.py``)."""

from __future__ import annotations

from typing import Any

from tidal.app.tool_parsers.base import ToolParser
from tidal.app.tool_parsers.calls import CallSyntax, NamedCall, Trigger
from tidal.app.tool_parsers.xml_parameters import CLOSE, OPEN, parameters_format


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    trigger = "<tool_call>"
    separator = "\n"
    syntax = CallSyntax(triggers=(Trigger("<tool_call>"),), closer="</tool_call>",
                        call=NamedCall(begin="<function=", name_end=">", end="</function>",
                                       xml=True),
                        markup=("<function=", OPEN, CLOSE, "</function>"))

    def call_tag(self, name: str, schema: dict[str, Any]) -> dict[str, Any]:
        """Qwen XML as xgrammar's own ``qwen_3_coder`` tag writes it, but with tidal's
        parameter grammar (``parameters_format``): xgrammar's ``qwen_xml`` style lets free
        whitespace around values blur where a string starts and ends, and lets a
        length-bounded string hold ``</parameter>``."""
        return {"type": "tag", "begin": f"<tool_call>\n<function={name}>\n",
                "content": parameters_format(schema), "end": "</function>\n</tool_call>"}
