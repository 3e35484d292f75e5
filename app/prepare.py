"""OpenAI requests translated into engine requests (the bodies' schemas: ``app/schemas.py``).

Every way a request can be wrong ends as an ``ApiError`` (``app/errors.py``) that names the
offending field (``param``) in OpenAI's error shape. ``prepare_chat_request`` and
``prepare_completion_request`` turn a parsed JSON body into token ids and ``SamplingParams``
ready for ``AsyncEngine.generate``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tidal.app.body_screen import check_prompt_count, check_tool_count
from tidal.app.conversation import (
    call_for_template,
    encode_prompt,
    fit_conversation,
    render_chat,
)
from tidal.app.errors import ApiError, bad_request
from tidal.app.reasoning import ReasoningFormat
from tidal.app.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
    validate_body,
)
from tidal.app.structured import (
    ToolUse,
    after_thinking,
    from_response_format,
    from_structured_outputs,
    reasoning_format_for,
    reply_constraint,
    tool_constraint,
)
from tidal.core.beam_search import MAX_BEAM_WIDTH, BeamSearchParams
from tidal.core.lifecycle import Arrival
from tidal.core.sampling_params import SamplingParams, check_token_ids, reply_budget
from tidal.core.structured_output import StructuredOutputsParams
from tidal.core.structured_output.limits import GrammarError, check_document

if TYPE_CHECKING:
    from tidal.app.server_state import ServerState

# -- prepared requests ----------------------------------------------------------------------
@dataclass
class StreamFlags:
    include_usage: bool = False
    continuous_usage_stats: bool = False


@dataclass
class PreparedRequest:
    """A validated chat request, templated and tokenized, ready for the engine."""

    request_id: str
    model: str
    prompt: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool = False
    stream_options: StreamFlags = field(default_factory=StreamFlags)
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    # With truncation: how many of the oldest non-system messages were left out to fit the
    # context; ``None`` when truncation was not asked for.
    dropped_messages: int | None = None
    tool_use: ToolUse | None = None  # the tools offered, and the parser of the reply's calls
    reasoning: ReasoningFormat | None = None  # where the reply's thinking ends, if it thinks
    timeout: float | None = None  # seconds it may wait and run: its own, or the server's
    priority: int = 0  # under the priority scheduling policy, the lower the sooner
    arrival: Arrival | None = None  # stamped by ``handling.prepare_off_loop``


@dataclass
class PromptInput:
    text: str
    token_ids: list[int]


@dataclass
class PreparedCompletion:
    """A validated text-completion request: one or more prompts, each ``n`` choices."""

    request_id: str
    model: str
    prompts: list[PromptInput]
    params: SamplingParams
    stream: bool = False
    stream_options: StreamFlags = field(default_factory=StreamFlags)
    echo: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # as asked (``params`` may score more, for ``echo``)
    created: int = field(default_factory=lambda: int(time.time()))
    timeout: float | None = None
    priority: int = 0
    beam: BeamSearchParams | None = None  # use_beam_search: the search's settings
    arrival: Arrival | None = None


def prepare_chat_request(body: dict[str, Any], state: ServerState, *,
                         require_model: bool = True, truncate: bool = False
                         ) -> PreparedRequest:
    """Validate an OpenAI chat request, apply the chat template, tokenize, and build the
    ``SamplingParams``. Raises ``ApiError`` naming the field at fault.

    With ``truncate`` (the websocket chat's ``"truncation": "auto"``), a conversation too long
    for the context loses its oldest turns instead of failing: see
    ``conversation.fit_conversation``."""
    if not require_model and body.get("model") is None:
        body = {**body, "model": state.served_model_name}
    req: ChatCompletionRequest = validate_body(ChatCompletionRequest, body)
    check_model(req.model, state)
    if req.tools is not None:
        check_tool_count(req.tools, state.settings.max_tools)
        try:  # depth and size, before the template or the tool parser walks them
            check_document(req.tools, "tools")
        except GrammarError as exc:
            raise bad_request(str(exc), exc.param, code=exc.code) from None
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    stream = _stream_flags(req)
    messages = [template_message(m) for m in req.messages]
    for i, m in enumerate(req.messages):
        if m.content is None and m.role != "assistant":
            raise bad_request(f"Invalid request: messages[{i}].content: this field is "
                              "required", f"messages[{i}].content")
    tool_use, tool_spec = tool_constraint(state, req.tools, req.tool_choice,
                                          req.parallel_tool_calls)
    max_field = "max_completion_tokens" if req.max_completion_tokens is not None \
        else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    top = req.top_logprobs or 0
    _check_prompt_logprobs(req)
    if max_tokens == 0:
        raise bad_request(f"Invalid request: {max_field} must be at least 1", max_field)
    params = _sampling_params(req, state, max_tokens=max_tokens,
                              logprobs=top if req.logprobs else None, names={
                                  "max_tokens": max_field, "logprobs": "top_logprobs"},
                              prompt_logprobs=req.prompt_logprobs)
    params = _constrained(params, req, tool_spec)
    tools = tool_use.tools if tool_use is not None else None
    if tool_use is not None and tool_use.parser.special_markers:
        params = params.clone(skip_special_tokens=False)  # the parser must see its markers
    dropped = None
    kwargs = template_kwargs(req)
    if truncate:
        prompt, token_ids, dropped = fit_conversation(state, messages, params, kwargs, tools)
    else:
        prompt = render_chat(state, messages, tools, kwargs)
        token_ids = encode_prompt(state, prompt, "messages", add_special_tokens=False)
    reasoning = reasoning_format_for(state)
    if reasoning is not None:
        reasoning = reasoning.for_prompt(prompt)
        if reasoning.harmony:  # the splitter must see Harmony's special tokens
            params = params.clone(skip_special_tokens=False)
    if params.structured_outputs is not None:  # it holds the answer, after any thinking
        params = params.clone(structured_outputs=after_thinking(params.structured_outputs,
                                                                reasoning))
    params = _fit_context(state, len(token_ids), params, "messages", max_field)
    check_client_token_ids(state, token_ids, "messages")
    check_request_tokens(state, [len(token_ids)], params, max_field)
    return PreparedRequest(
        request_id=f"chatcmpl-{uuid.uuid4().hex}", model=req.model, prompt=prompt,
        prompt_token_ids=token_ids, params=params, stream=bool(req.stream),
        stream_options=stream, logprobs=bool(req.logprobs), top_logprobs=top,
        prompt_logprobs=req.prompt_logprobs,
        dropped_messages=dropped, tool_use=tool_use, timeout=request_timeout(req, state),
        priority=request_priority(req, state),
        reasoning=reasoning)


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The chat template's extra variables: ``chat_template_kwargs``, and ``reasoning_effort``
    (which Harmony templates read) where the request sets it."""
    if req.reasoning_effort is None:
        return req.chat_template_kwargs
    return {**(req.chat_template_kwargs or {}), "reasoning_effort": req.reasoning_effort}


def template_message(m: ChatMessage) -> dict[str, Any]:
    """A message as the chat template takes it: string content, and the tool fields given."""
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.tool_calls is not None:
        out["tool_calls"] = [call_for_template(call) for call in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.reasoning_content is not None:
        out["reasoning_content"] = m.reasoning_content
    return out


def _constrained(params: SamplingParams, req: SamplingFields,
                 tool_spec: StructuredOutputsParams | None = None) -> SamplingParams:
    """``params`` with the one constraint the request puts on its reply, if any."""
    spec = reply_constraint(from_response_format(req.response_format),
                            from_structured_outputs(req.structured_outputs), tool_spec)
    return params if spec is None else params.clone(structured_outputs=spec)


def prepare_completion_request(body: dict[str, Any], state: ServerState
                               ) -> PreparedCompletion:
    check_prompt_count(body.get("prompt"), state.settings.max_prompts_per_request)
    req: CompletionRequest = validate_body(CompletionRequest, body)
    check_model(req.model, state)
    stream = _stream_flags(req)
    prompts = []
    for i, prompt in enumerate(req.prompt):
        param = "prompt" if len(req.prompt) == 1 else f"prompt[{i}]"
        if isinstance(prompt, str):
            ids = encode_prompt(state, prompt, param)
            prompts.append(PromptInput(prompt, ids))
        else:
            check_client_token_ids(state, prompt, param)
            prompts.append(PromptInput(state.tokenizer.decode(prompt), list(prompt)))
    params = _constrained(_sampling_params(req, state, max_tokens=req.max_tokens,
                                           logprobs=req.logprobs,
                                           prompt_logprobs=_prompt_scores(req)), req)
    for i, prompt in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        _fit_context(state, len(prompt.token_ids), params, param, "max_tokens")
    check_request_tokens(state, [len(p.token_ids) for p in prompts], params, "max_tokens")
    longest = max(len(p.token_ids) for p in prompts)
    beam = beam_search_params(req, params, reply_budget(params.max_tokens, longest,
                                                        state.context_tokens)
                              ) if req.use_beam_search else None
    return PreparedCompletion(
        beam=beam,
        request_id=f"cmpl-{uuid.uuid4().hex}", model=req.model, prompts=prompts, params=params,
        stream=bool(req.stream), stream_options=stream, echo=bool(req.echo),
        logprobs=req.logprobs, prompt_logprobs=req.prompt_logprobs,
        timeout=request_timeout(req, state), priority=request_priority(req, state))


def _check_prompt_logprobs(req: SamplingFields) -> None:
    """Prompt logprobs come whole, in a reply's first part: not in a stream (as vLLM)."""
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs are not available when stream is true",
                          "prompt_logprobs")


def _prompt_scores(req: CompletionRequest) -> int | None:
    """The top-k of each prompt position the engine computes for a completion: what
    ``prompt_logprobs`` asks, and what ``echo`` with ``logprobs`` shows of the echoed prompt.
    ``max_tokens`` 0 (only with ``echo``, as OpenAI's and vLLM's) scores the prompt alone."""
    _check_prompt_logprobs(req)
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("Invalid request: max_tokens may be 0 only with echo", "max_tokens")
    asked = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None)
             if k is not None]
    if asked:
        return max(asked)
    return 0 if req.max_tokens == 0 else None


def check_request_tokens(state: ServerState, prompt_lengths: list[int],
                         params: SamplingParams, max_param: str) -> None:
    """The tokens a request may put through the engine, each prompt's tokens once and
    ``n`` x its reply budget for each prompt (``reply_budget``: the room its context leaves
    where ``max_tokens`` is unset), within ``--max-request-tokens``."""
    limit = state.settings.max_request_tokens
    budgets = [reply_budget(params.max_tokens, n, state.context_tokens) for n in prompt_lengths]
    total = sum(prompt_lengths) + params.n * sum(budgets)
    max_tokens = max(budgets, default=0)
    if total > limit:
        prompts = f" x {len(prompt_lengths)} prompts" if len(prompt_lengths) > 1 else ""
        raise bad_request(
            f"This request may use {total} tokens (its prompt tokens + n {params.n} x "
            f"{max_param} {max_tokens}{prompts}), more than this server's limit of {limit} "
            f"a request; lower {max_param} or n", max_param, code="too_many_tokens")


def request_timeout(req: SamplingFields, state: ServerState) -> float | None:
    """The request's ``timeout``, capped by the server's ``--request-timeout``."""
    limits = [t for t in (req.timeout, state.settings.request_timeout) if t is not None]
    return min(limits) if limits else None


def beam_search_params(req: CompletionRequest, params: SamplingParams,
                       max_tokens: int) -> BeamSearchParams:
    """A beam-search completion's settings: ``n`` beams of up to ``max_tokens`` tokens (the
    room the context leaves where unset). What a beam search cannot do is a 400 naming it."""
    for name, unsupported in (("stream", req.stream), ("logprobs", req.logprobs is not None),
                              ("prompt_logprobs", req.prompt_logprobs is not None),
                              ("structured_outputs", params.structured_outputs is not None)):
        if unsupported:
            raise bad_request(f"{name} is not available with use_beam_search", name)
    if not 1 <= params.n <= MAX_BEAM_WIDTH:
        raise bad_request(f"use_beam_search takes n from 1 to {MAX_BEAM_WIDTH} beams", "n")
    return BeamSearchParams(params.n, max(1, max_tokens), ignore_eos=params.ignore_eos,
                            length_penalty=req.length_penalty,
                            early_stopping=req.early_stopping)


def request_priority(req: SamplingFields, state: ServerState) -> int:
    """The request's ``priority``: 0 unless the engine schedules by priority."""
    if req.priority and state.settings.scheduling_policy != "priority":
        raise bad_request("priority is set but this server schedules first come, first served; "
                          "start it with --scheduling-policy priority", "priority")
    return req.priority


def check_model(model: str, state: ServerState) -> None:
    if model != state.served_model_name:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves "
                            f"`{state.served_model_name}`.", "model", code="model_not_found")


def _stream_flags(req: SamplingFields) -> StreamFlags:
    opts = req.stream_options
    if opts is None:
        return StreamFlags()
    if not req.stream:
        raise bad_request("stream_options can only be set when stream is true",
                          "stream_options")
    return StreamFlags(bool(opts.include_usage), bool(opts.continuous_usage_stats))


def _sampling_params(req: SamplingFields, state: ServerState, max_tokens: int | None,
                     logprobs: int | None, names: dict[str, str] | None = None,
                     prompt_logprobs: int | None = None) -> SamplingParams:
    """Build ``SamplingParams``; its ``ValueError`` names the field, mapped back to the
    request's own field name through ``names``."""
    values: dict[str, Any] = {
        "n": req.n, "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
        "min_p": req.min_p, "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty, "seed": req.seed,
        "min_tokens": req.min_tokens, "stop_token_ids": req.stop_token_ids,
        "ignore_eos": req.ignore_eos,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "skip_special_tokens": req.skip_special_tokens,
    }
    values = {k: v for k, v in values.items() if v is not None}
    check_client_token_ids(state, req.stop_token_ids or [], "stop_token_ids")
    values.update(stop=req.stop, max_tokens=max_tokens, logprobs=logprobs,
                  prompt_logprobs=prompt_logprobs,
                  logit_bias=_logit_bias(req.logit_bias, state))
    try:
        return SamplingParams(**values)
    except ValueError as exc:
        message = str(exc)
        field_name = message.split(" ", 1)[0]
        param = (names or {}).get(field_name, field_name)
        if field_name != param:
            message = param + message[len(field_name):]
        raise bad_request(f"Invalid request: {message}", param) from None


def _logit_bias(bias: dict[str, float] | None, state: ServerState) -> dict[int, float] | None:
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}",
                              "logit_bias") from None
        check_client_token_ids(state, [token_id], "logit_bias", what="logit_bias token id")
        out[token_id] = value
    return out


def check_client_token_ids(state: ServerState, token_ids: list[int], param: str,
                           what: str = "token id") -> None:
    try:
        check_token_ids(token_ids, state.vocab_size, what)
    except ValueError as exc:
        raise bad_request(str(exc), param) from None


def _fit_context(state: ServerState, num_prompt: int, params: SamplingParams,
                 prompt_param: str, max_param: str) -> SamplingParams:
    """Reject a prompt or ``max_tokens`` that cannot fit the context or the KV cache; an
    unset ``max_tokens`` becomes the room the context leaves (``reply_budget``)."""
    limit = state.context_tokens
    if num_prompt == 0:
        raise bad_request("The prompt is empty", prompt_param)
    if num_prompt >= limit:
        raise bad_request(
            f"The prompt has {num_prompt} tokens but this model's context is {limit} tokens, "
            "leaving no room to generate", prompt_param, code="context_length_exceeded")
    room = limit - num_prompt
    if params.max_tokens is None:
        if params.min_tokens > room:
            raise bad_request(
                f"min_tokens is {params.min_tokens} but the prompt has {num_prompt} tokens and "
                f"the context is {limit} tokens, so at most {room} tokens can be generated",
                "min_tokens", code="context_length_exceeded")
        return params.clone(max_tokens=reply_budget(None, num_prompt, limit))
    if params.max_tokens > room:
        raise bad_request(
            f"{max_param} is {params.max_tokens} but the prompt has {num_prompt} tokens and the "
            f"context is {limit} tokens, so at most {room} tokens can be generated",
            max_param, code="context_length_exceeded")
    return params
