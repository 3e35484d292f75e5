"""The load generator's client against a raw server that drops connections: a request whose
connection closes before any response is sent again (as the openai client retries), and one
that never gets an answer is reported failed, not hung."""

from __future__ import annotations

import asyncio
import json

from bench.load_generator import SEND_TRIES, client_session, one_request

DONE = ("data: " + json.dumps({"choices": [{"index": 0, "text": "a", "finish_reason": "length"}]})
        + "\n\ndata: [DONE]\n\n")
ANSWER = (f"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: {len(DONE)}"
          f"\r\n\r\n{DONE}").encode()


async def _run(drops: int):
    """One request against a server that closes its first ``drops`` connections unanswered;
    the result and the number of connections it saw."""
    seen = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal seen
        seen += 1
        await reader.readuntil(b"\r\n\r\n")
        if seen > drops:
            writer.write(ANSWER)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server, client_session(f"http://127.0.0.1:{port}", 4) as client:
        result = await one_request(client, "m", [1, 2], 1)
    return result, seen


def test_a_dropped_connection_is_sent_again():
    result, seen = asyncio.run(_run(drops=1))
    assert result.ok and result.output_tokens == 1 and seen == 2


def test_a_request_never_answered_fails_after_its_tries():
    result, seen = asyncio.run(_run(drops=SEND_TRIES))
    assert not result.ok and "Disconnected" in result.error and seen == SEND_TRIES
