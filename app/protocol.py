"""The OpenAI request schemas, their validation, and their translation into engine requests.

Every way a request can be wrong ends as an ``ApiError`` (``app/errors.py``) that names the
offending field (``param``) in OpenAI's error shape. ``prepare_chat_request`` and
``prepare_completion_request`` turn a parsed JSON body into token ids and ``SamplingParams``
ready for ``AsyncEngine.generate``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from app.conversation import encode_prompt, fit_conversation, render_chat
from app.errors import ApiError, bad_request
from core.chat_messages import content_text
from core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from app.state import ServerState

MAX_N = 128
MAX_LOGPROBS = 20
# Stop strings are matched in every new piece of text, on the engine's thread: a request's
# share of that work stays small beside everyone else's step.
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024


def parse_json_body(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, whatever the Content-Type said."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}",
                          code="invalid_json") from exc
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object")
    return data


# -- schemas --------------------------------------------------------------------------------
class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Model):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingFields(_Model):
    """Fields shared by chat and text completions. ``None`` means the default."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    stop: Any = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> list[str]:
        if value is None:
            return []
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
            raise ValueError("must be a non-empty string or a list of non-empty strings")
        if len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(value)}")
        if max(len(s) for s in value) > MAX_STOP_CHARS:
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return value


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ChatMessage(_Model):
    role: Literal["system", "user", "assistant"]
    content: Any = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> Any:
        content_text(value)  # its ValueError names what is wrong
        return value

    def text(self) -> str:
        return content_text(self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


class CompletionRequest(_SamplingFields):
    prompt: Any
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> list[str | list[int]]:
        """Normalised to a list of prompts, each a string or a list of token ids."""
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and value:
            if all(_is_int(t) for t in value):
                return [value]
            if all(isinstance(p, str) for p in value):
                return value
            if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in value):
                return value
        raise ValueError("must be a string, a list of strings, a non-empty list of token ids,"
                         " or a list of non-empty token-id lists")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _validate(model: type[_Model], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = _param_name(err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            message = "this field is required"
        raise bad_request(f"Invalid request: {param}: {message}", param) from None


def _param_name(loc: tuple[Any, ...]) -> str:
    """``("messages", 0, "role")`` -> ``"messages[0].role"``."""
    name = ""
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        else:
            name += f".{part}" if name else str(part)
    return name


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
    created: int = field(default_factory=lambda: int(time.time()))
    # With truncation: how many of the oldest non-system messages were left out to fit the
    # context; ``None`` when truncation was not asked for.
    dropped_messages: int | None = None


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
    created: int = field(default_factory=lambda: int(time.time()))


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
    req: ChatCompletionRequest = _validate(ChatCompletionRequest, body)
    check_model(req.model, state)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    stream = _stream_flags(req)
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    for i, m in enumerate(req.messages):
        if m.content is None and m.role != "assistant":
            raise bad_request(f"Invalid request: messages[{i}].content: this field is "
                              "required", f"messages[{i}].content")
    max_field = "max_completion_tokens" if req.max_completion_tokens is not None \
        else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    top = req.top_logprobs or 0
    params = _sampling_params(req, state, max_tokens=max_tokens,
                              logprobs=top if req.logprobs else None, names={
                                  "max_tokens": max_field, "logprobs": "top_logprobs"})
    dropped = None
    if truncate:
        prompt, token_ids, dropped = fit_conversation(state, messages, params)
    else:
        prompt = render_chat(state, messages)
        token_ids = encode_prompt(state, prompt, "messages", add_special_tokens=False)
    params = _fit_context(state, len(token_ids), params, "messages", max_field)
    _check_token_ids(state, token_ids, "messages")
    return PreparedRequest(
        request_id=f"chatcmpl-{uuid.uuid4().hex}", model=req.model, prompt=prompt,
        prompt_token_ids=token_ids, params=params, stream=bool(req.stream),
        stream_options=stream, logprobs=bool(req.logprobs), top_logprobs=top,
        dropped_messages=dropped)


def prepare_completion_request(body: dict[str, Any], state: ServerState
                               ) -> PreparedCompletion:
    req: CompletionRequest = _validate(CompletionRequest, body)
    check_model(req.model, state)
    stream = _stream_flags(req)
    prompts = []
    for i, prompt in enumerate(req.prompt):
        param = "prompt" if len(req.prompt) == 1 else f"prompt[{i}]"
        if isinstance(prompt, str):
            ids = encode_prompt(state, prompt, param)
            prompts.append(PromptInput(prompt, ids))
        else:
            _check_token_ids(state, prompt, param)
            prompts.append(PromptInput(state.tokenizer.decode(prompt), list(prompt)))
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    params = _sampling_params(req, state, max_tokens=max_tokens, logprobs=req.logprobs)
    for i, prompt in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        _fit_context(state, len(prompt.token_ids), params, param, "max_tokens")
    return PreparedCompletion(
        request_id=f"cmpl-{uuid.uuid4().hex}", model=req.model, prompts=prompts, params=params,
        stream=bool(req.stream), stream_options=stream, echo=bool(req.echo),
        logprobs=req.logprobs)


def check_model(model: str, state: ServerState) -> None:
    if model != state.served_model_name:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves "
                            f"`{state.served_model_name}`.", "model", code="model_not_found")


def _stream_flags(req: _SamplingFields) -> StreamFlags:
    opts = req.stream_options
    if opts is None:
        return StreamFlags()
    if not req.stream:
        raise bad_request("stream_options can only be set when stream is true",
                          "stream_options")
    return StreamFlags(bool(opts.include_usage), bool(opts.continuous_usage_stats))


def _sampling_params(req: _SamplingFields, state: ServerState, max_tokens: int | None,
                     logprobs: int | None, names: dict[str, str] | None = None
                     ) -> SamplingParams:
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
    _check_token_ids(state, req.stop_token_ids or [], "stop_token_ids")
    values.update(stop=req.stop, max_tokens=max_tokens, logprobs=logprobs,
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
        if not 0 <= token_id < state.vocab_size:
            raise bad_request(f"logit_bias token id {token_id} is outside the vocabulary "
                              f"[0, {state.vocab_size})", "logit_bias")
        out[token_id] = value
    return out


def _check_token_ids(state: ServerState, token_ids: list[int], param: str) -> None:
    bad = next((t for t in token_ids if not 0 <= t < state.vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {state.vocab_size})",
                          param)


def _fit_context(state: ServerState, num_prompt: int, params: SamplingParams,
                 prompt_param: str, max_param: str) -> SamplingParams:
    """Reject a prompt or ``max_tokens`` that cannot fit the context or the KV cache; an
    unset ``max_tokens`` becomes whatever room is left."""
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
        return params.clone(max_tokens=room)
    if params.max_tokens > room:
        raise bad_request(
            f"{max_param} is {params.max_tokens} but the prompt has {num_prompt} tokens and the "
            f"context is {limit} tokens, so at most {room} tokens can be generated",
            max_param, code="context_length_exceeded")
    return params
