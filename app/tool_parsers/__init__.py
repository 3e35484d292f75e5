"""Tool calls in model replies: the Hermes/Qwen, Qwen3-Coder XML, Llama 3 JSON, Mistral,
DeepSeek and gpt-oss (Harmony) formats, parsed whole or as they stream, and the structural
tags that constrain a model to them."""

from tidal.app.tool_parsers.base import ToolChoice, ToolParser, resolve_tool_choice
from tidal.app.tool_parsers.calls import ParsedReply, StreamDelta, ToolCall
from tidal.app.tool_parsers.deepseek import DeepSeekV3ToolParser, DeepSeekV31ToolParser
from tidal.app.tool_parsers.hermes import HermesToolParser
from tidal.app.tool_parsers.llama3_json import Llama3JsonToolParser
from tidal.app.tool_parsers.mistral import MistralToolParser
from tidal.app.tool_parsers.mistral_v11 import MistralV11ToolParser
from tidal.app.tool_parsers.openai import OpenAIToolParser
from tidal.app.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from tidal.app.tool_parsers.registry import PARSERS, default_parser, get_parser
from tidal.app.tool_parsers.streaming import ToolCallStreamer

__all__ = [
    "PARSERS", "DeepSeekV3ToolParser", "DeepSeekV31ToolParser", "HermesToolParser",
    "Llama3JsonToolParser", "MistralToolParser", "MistralV11ToolParser", "OpenAIToolParser",
    "ParsedReply", "Qwen3CoderToolParser", "StreamDelta", "ToolCall", "ToolCallStreamer",
    "ToolChoice", "ToolParser", "default_parser", "get_parser", "resolve_tool_choice",
]
