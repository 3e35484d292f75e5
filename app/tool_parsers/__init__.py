"""Tool calls in model replies: the Hermes/Qwen, Llama 3 JSON and Mistral formats, parsed
whole or as they stream, and the structural tags that constrain a model to them."""

from tidal.app.tool_parsers.base import ToolChoice, ToolParser, resolve_tool_choice
from tidal.app.tool_parsers.calls import ParsedReply, StreamDelta, ToolCall
from tidal.app.tool_parsers.hermes import HermesToolParser
from tidal.app.tool_parsers.llama3_json import Llama3JsonToolParser
from tidal.app.tool_parsers.mistral import MistralToolParser
from tidal.app.tool_parsers.registry import PARSERS, default_parser, get_parser
from tidal.app.tool_parsers.streaming import ToolCallStreamer

__all__ = [
    "PARSERS", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser",
    "ParsedReply", "StreamDelta", "ToolCall", "ToolCallStreamer", "ToolChoice", "ToolParser",
    "default_parser", "get_parser", "resolve_tool_choice",
]
