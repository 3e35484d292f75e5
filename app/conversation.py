"""A chat's prompt: the conversation rendered through the model's chat template and tokenized,
and, for the websocket chat's ``"truncation": "auto"``, fitted to the context by dropping its
oldest turns."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from tidal.app.chat_template import ChatTemplateError
from tidal.app.errors import bad_request
from tidal.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tidal.app.server_state import ServerState


def encode_prompt(state: ServerState, text: str, param: str, add_special_tokens: bool = True
            ) -> list[int]:
    """The prompt's token ids; a prompt too long for the context in any tokenization is
    refused first, without tokenizing it."""
    if len(text) > state.max_prompt_chars:
        raise bad_request(
            f"The prompt has {len(text)} characters, more than this model's context of "
            f"{state.context_tokens} tokens can hold", param, code="context_length_exceeded")
    return _tokenize(state, text, add_special_tokens)


def _tokenize(state: ServerState, text: str, add_special_tokens: bool) -> list[int]:
    start = time.perf_counter()
    ids = state.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    state.metrics.tokenization_time.observe(time.perf_counter() - start)
    return ids


def call_for_template(call: Any) -> Any:
    """An earlier tool call with its ``arguments`` JSON text as the object it holds, as chat
    templates take it (Hugging Face's convention, and vLLM's): a template that writes each
    argument (Qwen3-Coder's parameters) cannot parse JSON. Text that is not a JSON object
    stays as it is."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except (ValueError, RecursionError):
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def render_chat(state: ServerState, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None,
                add_generation_prompt: bool = True) -> str:
    start = time.perf_counter()
    try:
        return state.chat_template.render(messages, add_generation_prompt, tools=tools,
                                          extra=template_kwargs)
    except ChatTemplateError as exc:
        raise bad_request(f"The chat template rejected the messages: {exc}",
                          "messages") from None
    except RecursionError:  # a message's tool calls or parts nested past Python's stack
        raise bad_request("The messages are nested too deeply to render", "messages",
                          code="nested_too_deeply") from None
    finally:
        state.metrics.chat_template_time.observe(time.perf_counter() - start)


def truncation_reserve(context_tokens: int) -> int:
    """How much room ``"truncation": "auto"`` clears for a reply without ``max_tokens``: half
    the context, at most 4,096. Only how many turns are dropped; the reply's budget is then
    ``reply_budget``'s, the room the kept turns leave."""
    return min(context_tokens // 2, 4096)


def fit_conversation(state: ServerState, messages: list[dict[str, str]],
                      params: SamplingParams, template_kwargs: dict[str, Any] | None = None,
                      tools: list[dict[str, Any]] | None = None
                      ) -> tuple[str, list[int], int]:
    """The conversation's prompt and token ids once its oldest turns are dropped until the
    prompt leaves room for the reply: ``max_tokens`` when given, else ``truncation_reserve`` (or
    ``min_tokens`` if more). Returns ``(prompt, token_ids, dropped)``, ``dropped`` counting
    the non-system messages left out from the front.

    System messages are always kept. Whole turns go: the kept messages after the cut start
    with a user message (or are the last message alone), as chat templates expect. The last
    message is never dropped; when even it (with the system messages) leaves less room than
    wanted, it is sent alone and ``prepare._fit_context`` then accepts it or refuses it as usual.
    Dropping fewer messages never makes a prompt shorter, so the fewest drops that fit are
    found by bisection: a handful of renders however long the conversation."""
    limit = state.context_tokens
    want = params.max_tokens if params.max_tokens is not None else max(
        params.min_tokens, truncation_reserve(limit))
    others = [i for i, m in enumerate(messages) if m["role"] != "system"]
    # the drop counts that start the kept messages at a turn: 0, each later user message,
    # and (the most one can drop) everything but the last message
    cuts = [d for d in range(len(others))
            if d == 0 or d == len(others) - 1 or messages[others[d]]["role"] == "user"] or [0]
    tried: dict[int, tuple[str, list[int] | None]] = {}

    def attempt(d: int) -> tuple[str, list[int] | None]:
        """The prompt without the first ``d`` non-system messages, and its token ids (None:
        too many characters to fit, left untokenized)."""
        if d not in tried:
            start = others[d] if others else 0
            kept = [m for i, m in enumerate(messages) if i >= start or m["role"] == "system"]
            prompt = render_chat(state, kept, tools, template_kwargs)
            ids = None if len(prompt) > state.max_prompt_chars else _tokenize(
                state, prompt, add_special_tokens=False)
            tried[d] = prompt, ids
        return tried[d]

    def fits(d: int) -> bool:
        ids = attempt(d)[1]
        return ids is not None and len(ids) + want <= limit

    lo, hi = 0, len(cuts) - 1  # the answer is cuts[hi] if nothing fewer fits
    if fits(cuts[0]):
        hi = 0
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        if fits(cuts[mid]):
            hi = mid
        else:
            lo = mid
    dropped = cuts[hi]
    prompt, ids = attempt(dropped)
    if ids is None:  # even the last message is too long: refused as without truncation
        ids = encode_prompt(state, prompt, "messages", add_special_tokens=False)
    return prompt, ids, dropped
