"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes: a prompt, or chat messages
rendered through the chat template, as token ids (and their strings); token ids as text.
Both read the body as every route does (API key, size limit) and tokenize off the loop."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tidal.app.body_screen import parse_json_body
from tidal.app.conversation import encode_prompt, render_chat
from tidal.app.errors import bad_request
from tidal.app.handling import get_state, read_body
from tidal.app.prepare import check_client_token_ids, check_model, template_message
from tidal.app.schemas import DetokenizeRequest, TokenizeRequest, validate_body
from tidal.app.server_state import ServerState


async def tokenize(request: Request) -> Response:
    return await _off_loop(request, _tokenize)


async def detokenize(request: Request) -> Response:
    return await _off_loop(request, _detokenize)


async def _off_loop(request: Request, work: Any) -> Response:
    state = get_state(request)
    raw = await read_body(request)
    loop = asyncio.get_running_loop()
    answer = await loop.run_in_executor(state.prepare_pool, work, raw, state)
    return JSONResponse(answer)


def _tokenize(raw: bytes, state: ServerState) -> dict[str, Any]:
    req: TokenizeRequest = validate_body(TokenizeRequest, parse_json_body(raw))
    _check_model(req.model, state)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("Invalid request: prompt: give either prompt or messages", "prompt")
    if req.messages is not None:
        text = render_chat(state, [template_message(m) for m in req.messages], None,
                           req.chat_template_kwargs, req.add_generation_prompt)
        special, param = bool(req.add_special_tokens), "messages"
    else:
        assert req.prompt is not None
        text, param = req.prompt, "prompt"
        special = req.add_special_tokens is None or req.add_special_tokens
    tokens = encode_prompt(state, text, param, add_special_tokens=special)
    answer: dict[str, Any] = {"tokens": tokens, "count": len(tokens),
                              "max_model_len": state.context_tokens}
    if req.return_token_strs:
        answer["token_strs"] = state.tokenizer.convert_ids_to_tokens(tokens)
    return answer


def _detokenize(raw: bytes, state: ServerState) -> dict[str, Any]:
    req: DetokenizeRequest = validate_body(DetokenizeRequest, parse_json_body(raw))
    _check_model(req.model, state)
    check_client_token_ids(state, req.tokens, "tokens")
    return {"prompt": state.tokenizer.decode(req.tokens)}


def _check_model(model: str | None, state: ServerState) -> None:
    if model is not None:
        check_model(model, state)
