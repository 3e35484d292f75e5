"""The structured-output benchmark's client: streamed completions read into replies that
keep their text, and each constrained reply's verdict (valid, cut by max_tokens, invalid)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import jsonschema
import orjson

from bench.load_generator import STREAM_ERRORS, RequestResult, client_session, scrape
from bench.server_metrics import server_side


@dataclass
class Reply(RequestResult):
    """A stream's timings as the load generator takes them, with its text and finish."""

    text: str = ""
    finish_reason: str | None = None


# -- what is sent ---------------------------------------------------------------------------


def _take_event(reply: Reply, event: dict[str, Any], now: float, last: float | None,
                start: float) -> float | None:
    """Fold one SSE event into ``reply``; the time of the last chunk with text."""
    if event.get("usage"):
        reply.output_tokens = event["usage"].get("completion_tokens", 0)
        reply.prompt_tokens = event["usage"].get("prompt_tokens", 0)
    for choice in event.get("choices") or []:
        reply.finish_reason = choice.get("finish_reason") or reply.finish_reason
        if not choice.get("text"):
            continue
        reply.text += choice["text"]
        if last is None:
            reply.ttft = now - start
        else:
            reply.itl.append(now - last)
        last = now
    return last


async def stream_one(client: aiohttp.ClientSession, body: dict[str, Any]) -> Reply:
    """One streamed completion, timed as ``load_generator.one_request`` times it (TTFT at the
    first chunk with text, output tokens from the usage), its text and finish reason kept."""
    reply, start, last, done = Reply(ok=False), time.perf_counter(), None, False
    try:
        async with client.post("/v1/completions", json=body) as resp:
            if resp.status != 200:
                reply.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return reply
            async for raw in resp.content:
                if not raw.startswith(b"data: "):
                    continue
                data = raw[6:].rstrip(b"\r\n")
                if data == b"[DONE]":
                    done = True
                    break
                event = orjson.loads(data)
                if "error" in event:
                    reply.error = str(event["error"])
                    return reply
                last = _take_event(reply, event, time.perf_counter(), last, start)
        reply.ok = done and last is not None
        reply.error = "" if reply.ok else "the stream ended without [DONE] or any text"
    except STREAM_ERRORS as exc:
        reply.error = repr(exc)
    reply.e2e = time.perf_counter() - start
    return reply


async def send_all(url: str, payloads: list[dict[str, Any]], concurrency: int
                   ) -> tuple[list[Reply], float, dict | None]:
    """Every body at ``concurrency`` in flight: the replies, the seconds it took and the
    server's side of it from ``/metrics``."""
    async with client_session(url, concurrency + 4) as client:
        limit = asyncio.Semaphore(concurrency)

        async def limited(body: dict[str, Any]) -> Reply:
            async with limit:
                return await stream_one(client, body)

        before = await scrape(client)
        start = time.perf_counter()
        replies = await asyncio.gather(*(limited(b) for b in payloads))
        duration = time.perf_counter() - start
        after = await scrape(client)
    side = server_side(before, after, duration) if before and after else None
    return list(replies), duration, side


# -- checking the constrained replies -------------------------------------------------------
def verdict(reply: Reply, schema: dict) -> str:
    """``valid``, ``cut`` (ended by max_tokens before the JSON closed), ``invalid`` (finished
    otherwise and does not parse or validate) or ``failed`` (the request itself failed)."""
    if not reply.ok:
        return "failed"
    try:
        jsonschema.validate(json.loads(reply.text), schema)
        return "valid"
    except (ValueError, jsonschema.ValidationError):
        return "cut" if reply.finish_reason == "length" else "invalid"


def validity(replies: list[Reply], schema: dict) -> dict[str, Any]:
    counts = {"valid": 0, "cut": 0, "invalid": 0, "failed": 0}
    examples = []
    for reply in replies:
        v = verdict(reply, schema)
        counts[v] += 1
        if v == "invalid" and len(examples) < 3:
            examples.append({"finish_reason": reply.finish_reason, "text": reply.text[:300]})
    return counts | {"invalid_examples": examples}


# -- the runs -------------------------------------------------------------------------------
