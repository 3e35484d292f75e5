"""The tool-call formats by name, and the one a chat template writes."""

from __future__ import annotations

from typing import Any

from tidal.app.harmony import CALL, CHANNEL
from tidal.app.tool_parsers.base import ToolParser
from tidal.app.tool_parsers.deepseek import CALL_BEGIN, DeepSeekV3ToolParser, DeepSeekV31ToolParser
from tidal.app.tool_parsers.hermes import HermesToolParser
from tidal.app.tool_parsers.llama3_json import Llama3JsonToolParser
from tidal.app.tool_parsers.mistral import MistralToolParser
from tidal.app.tool_parsers.mistral_v11 import MistralV11ToolParser
from tidal.app.tool_parsers.openai import OpenAIToolParser
from tidal.app.tool_parsers.qwen3_coder import Qwen3CoderToolParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "mistral_v11": MistralV11ToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV31ToolParser,
    "openai": OpenAIToolParser,
}


def get_parser(name: str, tools: list[dict[str, Any]] | None = None) -> ToolParser:
    """The format ``name``, reading the replies to a request offering ``tools``."""
    try:
        parser = PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; "
                         f"one of {', '.join(PARSERS)}") from None
    return parser(tools)


def default_parser(chat_template_text: str | None) -> str | None:
    """The format a chat template teaches its model, by the markers it contains."""
    text = chat_template_text or ""
    if CHANNEL in text and CALL in text:  # Harmony (gpt-oss)
        return "openai"
    if "<function=" in text and "<tool_call>" in text:
        return "qwen3_coder"
    if "<tool_call>" in text:
        return "hermes"
    if "[ARGS]" in text:
        return "mistral_v11"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if CALL_BEGIN in text:
        return "deepseek_v3" if "```json" in text else "deepseek_v31"
    if "<|python_tag|>" in text or '"parameters"' in text and "ipython" in text:
        return "llama3_json"
    return None
