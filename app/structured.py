"""What a request says its reply must match — OpenAI's ``response_format``, vLLM's
``structured_outputs``, and ``tools`` with ``tool_choice`` — as the engine's
``StructuredOutputsParams``. Errors name the field at fault."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tidal.app.errors import bad_request
from tidal.app.harmony import final_format
from tidal.app.reasoning import ReasoningFormat, default_format, get_format, thinking_format
from tidal.app.tool_parsers import ToolParser, default_parser, get_parser
from tidal.core.structured_output import StructuredOutputsParams
from tidal.core.structured_output.limits import GrammarError
from tidal.core.structured_output.params import KINDS

if TYPE_CHECKING:
    from tidal.app.server_state import ServerState


@dataclass
class ToolUse:
    """A chat request's tools, as the template and the reply's parser need them."""

    tools: list[dict[str, Any]]  # passed to the chat template
    parser: ToolParser  # reads the calls out of the reply


def spec_of(**constraint: Any) -> StructuredOutputsParams:
    """``StructuredOutputsParams(**constraint)``; one past the grammar size limits
    (``core.structured_output.limits``) is a 400 naming its field."""
    try:
        return StructuredOutputsParams(**constraint)
    except GrammarError as exc:
        raise bad_request(str(exc), exc.param, code=exc.code) from None


def from_response_format(value: Any) -> StructuredOutputsParams | None:
    """``{"type": "text" | "json_object" | "json_schema", "json_schema": {name, schema,
    strict}}`` as OpenAI takes it."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return spec_of(json_object=True, field="response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema must be a JSON schema "
                              "(an object)", "response_format.json_schema.schema")
        return spec_of(json=schema, field="response_format.json_schema.schema")
    raise bad_request("response_format.type must be 'text', 'json_object' or 'json_schema', "
                      f"got {kind!r}", "response_format.type")


def from_structured_outputs(value: Any) -> StructuredOutputsParams | None:
    """vLLM's ``structured_outputs``: exactly one of ``json``, ``json_object``, ``regex``,
    ``choice``, ``grammar`` or ``structural_tag``."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request("structured_outputs must be an object", "structured_outputs")
    given = {k: v for k, v in value.items() if k in KINDS and v not in (None, False)}
    if len(given) != 1:
        raise bad_request(f"structured_outputs must set exactly one of {', '.join(KINDS)}",
                          "structured_outputs")
    (kind, constraint), = given.items()
    try:
        return spec_of(**{kind: constraint}, field=f"structured_outputs.{kind}")
    except (TypeError, ValueError) as exc:
        raise bad_request(str(exc), f"structured_outputs.{kind}") from None


def reasoning_format_for(state: ServerState) -> ReasoningFormat | None:
    """The server's ``--reasoning-parser``, else the one its chat template's markers name;
    None where replies are not split (``none``, or a template without thinking)."""
    name = state.settings.reasoning_parser
    if name in (None, "auto"):
        name = default_format(state.chat_template.text)
    return None if name in (None, "none") else get_format(name)


def tool_parser_for(state: ServerState, tools: list[dict[str, Any]] | None = None
                    ) -> ToolParser:
    """The server's ``--tool-call-parser``, else the one its chat template's format names,
    else Hermes', reading the replies to a request offering ``tools``."""
    name = state.settings.tool_call_parser
    if name in (None, "auto"):
        name = default_parser(state.chat_template.text) or "hermes"
    return get_parser(name, tools)


def tool_constraint(state: ServerState, tools: list[dict[str, Any]] | None, tool_choice: Any,
                    parallel_tool_calls: bool | None
                    ) -> tuple[ToolUse | None, StructuredOutputsParams | None]:
    """The tools to show the model and the grammar its reply must follow; none of either
    without tools or with ``tool_choice: "none"``."""
    if tool_choice is not None and not tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    if not tools or tool_choice == "none":
        return None, None
    try:
        parser = tool_parser_for(state, tools)
        tag = parser.structural_tag(tools, tool_choice or "auto",
                                    parallel_tool_calls is not False)
    except ValueError as exc:
        message = str(exc)
        param = "tool_choice" if "tool_choice" in message else "tools"
        raise bad_request(message, param) from None
    spec = None if tag is None else spec_of(structural_tag=tag, field="tools")
    return ToolUse(tools, parser), spec


def reply_constraint(*specs: StructuredOutputsParams | None) -> StructuredOutputsParams | None:
    """The one constraint among those a request gave; two at once is an error."""
    given = [s for s in specs if s is not None]
    if len(given) > 1:
        fields = [s.field.split(".")[0] for s in given]
        raise bad_request(f"only one of {' and '.join(fields)} can constrain the reply",
                          fields[-1])
    return given[0] if given else None


def after_thinking(spec: StructuredOutputsParams | None, fmt: ReasoningFormat | None
                   ) -> StructuredOutputsParams | None:
    """``spec`` held to the answer alone: the reply's thinking first, free, then ``spec``
    (where the reply thinks at all). In Harmony the answer is the final message's body, but
    the tools' grammar writes its own messages (``tool_parsers/openai.py``)."""
    thinking = None if spec is None or fmt is None else thinking_format(fmt)
    if thinking is None:
        return spec
    assert spec is not None
    try:
        answer = spec.as_format()
    except ValueError as exc:
        raise bad_request(str(exc), spec.field) from None
    if fmt is not None and fmt.harmony and spec.field != "tools":
        answer = final_format(answer)
    tag = {"type": "structural_tag",
           "format": {"type": "sequence", "elements": [thinking, answer]}}
    return spec_of(structural_tag=tag, field=spec.field)
