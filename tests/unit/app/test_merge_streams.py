"""``merge_streams``: a completion's prompts, their delta streams merged, a few at a time."""

from __future__ import annotations

import asyncio

from tidal.app.handling import merge_streams


async def test_merged_streams_run_at_most_so_many_at_once() -> None:
    """Five prompts' streams, two at a time: each next one starts as one ends, and every
    delta arrives tagged with its prompt."""
    running: list[int] = []
    most = 0

    async def stream(index: int):
        nonlocal most
        running.append(index)
        most = max(most, len(running))
        for step in range(3):
            await asyncio.sleep(0.001 * (index % 3))
            yield (index, step)
        running.remove(index)

    got = [(i, out) async for i, out in merge_streams([stream(i) for i in range(5)], 2)]
    assert most == 2 and not running
    assert sorted(got) == [(i, (i, step)) for i in range(5) for step in range(3)]


async def test_leaving_merged_streams_early_stops_those_started_and_starts_no_more() -> None:
    started: list[int] = []
    closed: list[int] = []

    async def stream(index: int):
        started.append(index)
        try:
            while True:
                await asyncio.sleep(0)
                yield index
        finally:
            closed.append(index)

    merged = merge_streams([stream(i) for i in range(6)], 3)
    async for _ in merged:
        break
    await merged.aclose()
    assert sorted(started) == [0, 1, 2] and sorted(closed) == [0, 1, 2]
