"""The OpenAI request bodies as pydantic models, and their validation into ``ApiError``s
that name the field at fault."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tidal.app.errors import bad_request
from tidal.core.chat_messages import content_text

MAX_N = 128
MAX_LOGPROBS = 20
# Stop strings are matched in every new piece of text, on the engine's thread: a request's
# share of that work stays small beside everyone else's step.
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024


# -- schemas --------------------------------------------------------------------------------
class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Model):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(_Model):
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
    response_format: Any = None  # OpenAI's: text, json_object, json_schema
    structured_outputs: Any = None  # vLLM's: json, regex, choice, grammar, ...
    # vLLM's: the logprob of each prompt token and the top-k of its position
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # seconds the request may wait and run, from its arrival (the server's own limit, if
    # lower, wins)
    timeout: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    # under --scheduling-policy priority: the lower, the sooner (vLLM's field)
    priority: int = Field(default=0, ge=-(1 << 31), lt=1 << 31)

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


class ChatMessage(_Model):
    role: Literal["system", "user", "assistant", "tool"]
    content: Any = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None  # an assistant's earlier thinking (Harmony shows it)

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> Any:
        content_text(value)  # its ValueError names what is wrong
        return value

    def text(self) -> str:
        return content_text(self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None  # "none", "auto", "required" or {"type": "function", ...}
    parallel_tool_calls: bool | None = None
    # extra variables for the chat template, e.g. {"enable_thinking": false}; the names the
    # template is rendered with (messages, tools, ...) cannot be replaced
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Any = None  # OpenAI's: low, medium or high; the template reads it

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_template_kwargs(value)

    @field_validator("reasoning_effort")
    @classmethod
    def _reasoning_effort(cls, value: Any) -> str | None:
        if value is not None and value not in REASONING_EFFORTS:
            raise ValueError(f"must be one of {', '.join(REASONING_EFFORTS)}, not {value!r}")
        return value


REASONING_EFFORTS = ("low", "medium", "high")


def check_template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """``chat_template_kwargs`` may not replace the names the template is rendered with."""
    reserved = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                "unk_token", "pad_token"} & set(value or {})
    if reserved:
        raise ValueError(f"{', '.join(sorted(reserved))} cannot be set here")
    return value


class CompletionRequest(SamplingFields):
    prompt: Any
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    # vLLM's beam search: ``n`` beams, scored as HF's generate (core/beam_search.py)
    use_beam_search: bool = False
    length_penalty: float = Field(default=1.0, allow_inf_nan=False)
    early_stopping: Any = False  # True, False or "never"

    @field_validator("early_stopping", mode="before")
    @classmethod
    def _early_stopping(cls, value: Any) -> bool | str:
        if value is None:
            return False
        if value is True or value is False or value == "never":
            return value
        raise ValueError('must be true, false or "never"')

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


class ResponsesRequest(_Model):
    """``POST /v1/responses``: the fields this server reads (others are ignored); its
    translation into a chat request is ``app/responses_request.py``'s."""

    model: str | None = None  # None: the served model
    input: Any  # a string or a list of input items (``app/responses_input.py``)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": ...}}
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None  # {"effort": ...}: the chat's reasoning_effort
    background: bool | None = False  # not offered


class TokenizeRequest(_Model):
    """vLLM's ``POST /tokenize``: a ``prompt``, or chat ``messages`` through the template."""

    model: str | None = None  # None: the served model
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True  # messages only
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_template_kwargs(value)


class DetokenizeRequest(_Model):
    """vLLM's ``POST /detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(_Model):
    """``POST /v1/embeddings`` (OpenAI's): ``input`` normalised to a list of prompts."""

    model: str | None = None  # None: the served model
    input: Any
    dimensions: int | None = Field(default=None, ge=1)  # Matryoshka: the first ones, renormed
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, value: Any) -> list[str | list[int]]:
        return pooling_inputs(value)


class ClassifyRequest(_Model):
    """vLLM's ``POST /v1/classify``: each ``input`` (as in embeddings) scored by a sequence
    classifier."""

    model: str | None = None
    input: Any
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, value: Any) -> list[str | list[int]]:
        return pooling_inputs(value)


def pooling_inputs(value: Any) -> list[str | list[int]]:
    """An embeddings or classify ``input`` as a list of prompts (strings or token-id lists)."""
    if isinstance(value, str) and value:
        return [value]
    if isinstance(value, list) and value:
        if all(_is_int(t) for t in value):
            return [value]
        if all(isinstance(p, str) and p for p in value):
            return value
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in value):
            return value
    raise ValueError("must be a non-empty string, a list of non-empty strings, a "
                     "non-empty list of token ids, or a list of non-empty token-id lists")


class ScoreRequest(_Model):
    """vLLM's ``POST /v1/score``: ``text_1`` against each of ``text_2`` (one to many), or
    pairwise when both are lists of the same length."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(_Model):
    """vLLM's (Jina's and Cohere's) ``POST /v1/rerank``: ``documents`` ranked by relevance
    to ``query``, the best ``top_n`` (0 or None: all)."""

    model: str | None = None
    query: str = Field(min_length=1)
    documents: list[str] = Field(min_length=1)
    top_n: int | None = Field(default=None, ge=0)
    return_documents: bool = True


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_body(model: type[_Model], body: dict[str, Any]) -> Any:
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
