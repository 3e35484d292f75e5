"""A tool-call format: how to read calls out of a reply, and the xgrammar structural tag
that makes the model write them validly."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from tidal.app.tool_parsers.calls import CallSyntax, ParsedReply
from tidal.app.tool_parsers.streaming import ToolCallStreamer, split_reply

EMPTY_PARAMETERS = {"type": "object"}


@dataclass(frozen=True)
class ToolChoice:
    """A request's tool choice resolved against its tools: ``mode`` is "auto" (text or
    calls), "required" (one or more calls, the reply calls only) or "named" (exactly one call
    of the one function); ``functions`` maps the callable names to their schemas."""

    mode: str
    functions: dict[str, dict[str, Any]]

    def parallel(self, parallel_tool_calls: bool) -> bool:
        """Whether a second call may follow the first: never for a named function."""
        return parallel_tool_calls and self.mode != "named"


def function_schemas(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each OpenAI function tool's name and parameters schema, in the tools' order."""
    schemas: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        tool = tool if isinstance(tool, dict) else {}
        function = tool.get("function") if isinstance(tool.get("function"), dict) else {}
        name = function.get("name")
        if tool.get("type", "function") != "function" or not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': "
                             f"{{'name': ..., 'parameters': ...}}}}")
        if name in schemas:
            raise ValueError(f"tools: the function name {name!r} appears twice")
        schemas[name] = function.get("parameters") or EMPTY_PARAMETERS
    return schemas


def resolve_tool_choice(tools: list[dict[str, Any]] | None, tool_choice: Any
                        ) -> ToolChoice | None:
    """None where the reply is unconstrained (``"none"``, or ``"auto"`` without tools)."""
    schemas = function_schemas(tools or [])
    if tool_choice == "none" or tool_choice in (None, "auto") and not schemas:
        return None
    if tool_choice in (None, "auto"):
        return ToolChoice("auto", schemas)
    if tool_choice == "required":
        if not schemas:
            raise ValueError("tool_choice is 'required' but no tools were given")
        return ToolChoice("required", schemas)
    name = _named_function(tool_choice)
    if name not in schemas:
        raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")
    return ToolChoice("named", {name: schemas[name]})


def _named_function(tool_choice: Any) -> str:
    choice = tool_choice if isinstance(tool_choice, dict) else {}
    function = choice.get("function") if isinstance(choice.get("function"), dict) else {}
    name = function.get("name")
    if choice.get("type") != "function" or not isinstance(name, str):
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or "
                         "{'type': 'function', 'function': {'name': ...}}, "
                         f"not {tool_choice!r}")
    return name


def json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": schema}


def calls_format(tags: list[dict[str, Any]], separator: str, parallel: bool
                 ) -> dict[str, Any]:
    """One or more of ``tags`` (exactly one unless ``parallel``), ``separator`` between."""
    return {"type": "tags_with_separator", "tags": tags, "separator": separator,
            "at_least_one": True, "stop_after_first": not parallel}


class ToolParser(ABC):
    """A format's calls: ``extract`` for a whole reply, ``streamer`` for one arriving in
    deltas, ``structural_tag`` for the grammar that keeps the model to the format. Built with a
    request's ``tools``, it reads values their parameters' schemas type (Qwen3-Coder's)."""

    name: ClassVar[str]
    syntax: ClassVar[CallSyntax]
    trigger: ClassVar[str]  # what opens a call in free text, for the grammar
    separator: ClassVar[str]  # between calls where the reply is calls only
    # its markers are special tokens, which the detokenizer must not skip
    special_markers: ClassVar[bool] = False

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.schemas = function_schemas(tools or [])

    def extract(self, text: str, cut: bool = False) -> ParsedReply:
        """A whole reply's content and calls (``cut``: it ran into ``max_tokens``)."""
        return split_reply(self.syntax, text, cut, self.schemas)

    def streamer(self) -> ToolCallStreamer:
        return ToolCallStreamer(self.syntax, self.schemas)

    def structural_tag(self, tools: list[dict[str, Any]] | None, tool_choice: Any = "auto",
                       parallel_tool_calls: bool = True) -> dict[str, Any] | None:
        """The xgrammar structural tag for a request's tools, None where the reply is free."""
        choice = resolve_tool_choice(tools, tool_choice)
        if choice is None:
            return None
        tags = [self.call_tag(name, schema) for name, schema in choice.functions.items()]
        parallel = choice.parallel(parallel_tool_calls)
        if choice.mode == "auto":
            body = self.auto_format(tags, parallel)
        else:
            body = self.forced_format(tags, parallel)
        return {"type": "structural_tag", "format": body}

    @abstractmethod
    def call_tag(self, name: str, schema: dict[str, Any]) -> dict[str, Any]:
        """The tag one call to ``name`` is written as, its arguments held to ``schema``."""

    def auto_format(self, tags: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
        """Free text, where each trigger opens one of ``tags`` (or, for a format that lists its
        calls, the one list, which ends the reply); the format's other markers may not appear
        in the text (they would be call markup in the content)."""
        if self.syntax.listed is not None:
            tags, parallel = [self.forced_format(tags, parallel)], False
        return {"type": "triggered_tags", "triggers": [self.trigger], "tags": tags,
                "at_least_one": False, "stop_after_first": not parallel,
                "excludes": self.text_excludes()}

    def markers(self) -> list[str]:
        """Every marker of the format's calls: its triggers, its closer and its markup."""
        return self.syntax.markers()

    def text_excludes(self) -> list[str]:
        """The markers free text may not contain: all but the grammar's own trigger, which
        opens a call, and the JSON openers of formats whose calls are bare objects."""
        return [m for m in self.markers() if m != self.trigger and not m.startswith("{")]

    def forced_format(self, tags: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
        """Calls only, at least one (in the one list of a format that lists its calls, after
        its trigger)."""
        calls = calls_format(tags, self.separator, parallel)
        listed = self.syntax.listed
        if listed is None:
            return calls
        return {"type": "tag", "begin": self.trigger + listed.opener, "content": calls,
                "end": listed.closer}
