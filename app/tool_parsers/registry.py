"""The tool-call formats by name, and the one a chat template writes."""

from __future__ import annotations

from tidal.app.tool_parsers.base import ToolParser
from tidal.app.tool_parsers.hermes import HermesToolParser
from tidal.app.tool_parsers.llama3_json import Llama3JsonToolParser
from tidal.app.tool_parsers.mistral import MistralToolParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; "
                         f"one of {', '.join(PARSERS)}") from None


def default_parser(chat_template_text: str | None) -> str | None:
    """The format a chat template teaches its model, by the markers it contains."""
    text = chat_template_text or ""
    if "<tool_call>" in text:
        return "hermes"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or '"parameters"' in text and "ipython" in text:
        return "llama3_json"
    return None
