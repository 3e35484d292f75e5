"""Large request bodies screened in a process of their own before the server parses them.

Parsing holds Python's interpreter lock: a 4 MiB body of a million one-character prompts takes
tens of milliseconds to parse, and while a thread of the server parses it no other thread, the
event loop included, runs Python. A client sending such bodies one after another (each refused
by the caps below, but only once parsed) slowed every other client's requests 20-fold on two
cores. So a body past ``LARGE_BODY_BYTES`` is first parsed in a worker process, which checks
the caps that bound how many objects a request may hold: the JSON itself (orjson's own depth
limit of 1,024), the number of prompts and the number of tools. A body refused there is never
parsed by the server; one that passes is parsed again by the server, as any other.

The checks here are the only ones of their kind: the server's preparation calls them too
(``app/prepare.py``).
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import Executor, ProcessPoolExecutor
from typing import Any

import orjson

from tidal.app.errors import ApiError, bad_request

LARGE_BODY_BYTES = 256 << 10  # bodies past this are screened first
# (status, message, param, code): an ApiError as it crosses the process boundary
Refusal = tuple[int, str, "str | None", "str | None"]


def check_prompt_count(prompt: Any, limit: int) -> None:
    """At most ``limit`` prompts (a list of strings or of token-id lists; a list of ints is
    one prompt), checked on the parsed body before anything is validated or tokenized."""
    if (isinstance(prompt, list) and len(prompt) > limit
            and isinstance(prompt[0], (str, list))):
        raise bad_request(f"prompt has {len(prompt)} prompts, more than this server's limit "
                          f"of {limit} per request", "prompt", code="too_many_prompts")


def check_tool_count(tools: Any, limit: int) -> None:
    if isinstance(tools, list) and len(tools) > limit:
        raise bad_request(f"tools has {len(tools)} tools, more than this server's limit of "
                          f"{limit}", "tools", code="too_many_tools")


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


def screen(raw: bytes, max_prompts: int, max_tools: int) -> Refusal | None:
    """In the worker process: why the body is refused, or None."""
    try:
        body = parse_json_body(raw)
        check_prompt_count(body.get("prompt"), max_prompts)
        check_tool_count(body.get("tools"), max_tools)
    except ApiError as exc:
        return exc.status, exc.message, exc.param, exc.code
    return None


def raise_refusal(refusal: Refusal | None) -> None:
    if refusal is not None:
        status, message, param, code = refusal
        raise ApiError(status, message, param, code=code)


def screen_pool() -> Executor:
    """One worker process (spawned: nothing of the server's threads or state comes with it)."""
    return ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
