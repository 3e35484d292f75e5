"""A Responses API request (``POST /v1/responses``) translated into the chat request the chat
endpoint prepares: ``instructions`` and ``input`` (after a ``previous_response_id``'s
conversation) become ``messages``, ``tools`` and ``tool_choice`` take the chat shape,
``text.format`` becomes ``response_format``, ``max_output_tokens`` becomes
``max_completion_tokens``, ``reasoning.effort`` becomes ``reasoning_effort``.
``prepare_chat_request`` then validates, templates and tokenizes it, exactly as it does a chat
request; what it refuses is reported under the Responses API's own field names
(``responses_param``).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tidal.app.errors import ApiError, bad_request
from tidal.app.prepare import PreparedRequest, prepare_chat_request
from tidal.app.responses_input import input_messages
from tidal.app.schemas import ResponsesRequest, validate_body
from tidal.core.lifecycle import Arrival

if TYPE_CHECKING:
    from tidal.app.server_state import ServerState

# The chat request's fields a Responses request may also set (vLLM's extensions among them);
# they go to the chat request as they are.
SAMPLING_EXTRAS = ("top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "logit_bias", "ignore_eos",
                   "min_tokens", "include_stop_str_in_output", "skip_special_tokens", "timeout",
                   "user", "structured_outputs", "chat_template_kwargs", "priority")
# A chat field's name (or its start) -> the Responses field it came from
RENAMED = (("max_completion_tokens", "max_output_tokens"),
           ("response_format.json_schema.schema", "text.format.schema"),
           ("response_format.json_schema", "text.format"),
           ("response_format", "text.format"), ("messages", "input"),
           ("reasoning_effort", "reasoning.effort"))


@dataclass
class PreparedResponse:
    """A Responses request prepared: the chat request the engine runs, and what the response
    object repeats and the store keeps."""

    id: str
    chat: PreparedRequest
    echo: dict[str, Any]  # the request's fields the response object repeats
    conversation: list[dict[str, Any]]  # chat messages without the instructions
    store: bool = True
    stream: bool = False
    created_at: int = 0

    # what ``handling.prepare_off_loop`` reads and stamps on every prepared request
    @property
    def params(self) -> Any:
        return self.chat.params

    @property
    def timeout(self) -> float | None:
        return self.chat.timeout

    @property
    def priority(self) -> int:
        return self.chat.priority

    @property
    def arrival(self) -> Arrival | None:
        return self.chat.arrival

    @arrival.setter
    def arrival(self, value: Arrival | None) -> None:
        self.chat.arrival = value


def prepare_response_request(body: dict[str, Any], state: ServerState) -> PreparedResponse:
    """Validate a Responses request and prepare its chat request; ``ApiError`` naming the
    Responses field at fault."""
    with renamed_errors():
        return _prepare(body, state)


def _prepare(body: dict[str, Any], state: ServerState) -> PreparedResponse:
    req: ResponsesRequest = validate_body(ResponsesRequest, body)
    if req.background:
        raise bad_request("background responses are not offered by this server", "background")
    conversation = _earlier_conversation(state, req.previous_response_id)
    conversation += input_messages(req.input)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    chat = {"model": req.model or state.served_model_name, "messages": system + conversation,
            **{k: body[k] for k in SAMPLING_EXTRAS if k in body}}
    chat.update(_sampling(req), **_tools(req))
    if (req.reasoning or {}).get("effort") is not None:
        chat["reasoning_effort"] = req.reasoning["effort"]
    if req.text is not None and req.text.get("format") is not None:
        chat["response_format"] = _response_format(req.text["format"])
    prepared = prepare_chat_request(chat, state)
    prepared.request_id = f"resp_{uuid.uuid4().hex}"
    return PreparedResponse(id=prepared.request_id, chat=prepared, echo=_echo(req),
                            conversation=conversation, store=req.store is not False,
                            stream=bool(req.stream), created_at=prepared.created)


def _earlier_conversation(state: ServerState, previous_id: str | None) -> list[dict[str, Any]]:
    if previous_id is None:
        return []
    stored = state.responses.get(previous_id)
    if stored is None:
        raise ApiError(404, f"Previous response with id {previous_id!r} not found",
                       "previous_response_id", code="previous_response_not_found")
    return list(stored.conversation)


def _sampling(req: ResponsesRequest) -> dict[str, Any]:
    values = {"max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
              "top_p": req.top_p}
    return {k: v for k, v in values.items() if v is not None}


def _tools(req: ResponsesRequest) -> dict[str, Any]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` in the chat shape."""
    out: dict[str, Any] = {}
    if req.tools is not None:
        out["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(req.tools)]
    if req.tool_choice is not None:
        out["tool_choice"] = _chat_tool_choice(req.tool_choice)
    if req.parallel_tool_calls is not None:
        out["parallel_tool_calls"] = req.parallel_tool_calls
    return out


def _chat_tool(tool: Any, i: int) -> dict[str, Any]:
    """``{"type": "function", "name", "description", "parameters", "strict"}`` as the chat's
    ``{"type": "function", "function": {...}}``."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise bad_request(f"{where}.type must be 'function' (the only tools offered), got "
                          f"{kind!r}", f"{where}.type")
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.name must be a non-empty string", f"{where}.name")
    if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
        raise bad_request(f"{where}.parameters must be a JSON schema (an object)",
                          f"{where}.parameters")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', "
                      f"'name': ...}}, not {choice!r}", "tool_choice")


def _response_format(fmt: Any) -> Any:
    """``text.format`` as the chat's ``response_format``, which the chat request checks."""
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {
            k: fmt.get(k) for k in ("name", "schema", "strict") if k in fmt}}
    return fmt


def _echo(req: ResponsesRequest) -> dict[str, Any]:
    return {
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p,
        "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
        "previous_response_id": req.previous_response_id, "store": req.store is not False,
        "metadata": req.metadata or {}, "truncation": "disabled",
        "reasoning": {"effort": req.reasoning.get("effort"), "summary": None}
        if req.reasoning else None,
    }


def responses_param(name: str | None) -> str | None:
    """A chat request's field name as the Responses field it came from."""
    for chat_name, responses_name in RENAMED:
        if name is not None and (name == chat_name or name.startswith(chat_name + ".")
                                 or name.startswith(chat_name + "[")):
            if chat_name == "messages":
                return responses_name  # the messages do not map one to one to input items
            return responses_name + name[len(chat_name):]
    if name is not None and name.startswith("tools[") and ".function." in name:
        return name.replace(".function.", ".", 1)
    return name


@contextlib.contextmanager
def renamed_errors() -> Iterator[None]:
    """Re-raise an ``ApiError`` with its field named as the Responses API names it."""
    try:
        yield
    except ApiError as exc:
        param = responses_param(exc.param)
        if exc.param is not None and param != exc.param:
            exc.message = exc.message.replace(exc.param, param or "")
            exc.param = param
        raise
