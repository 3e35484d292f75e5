"""One grammar compile at a time per client: a client's second grammar waits for its first,
another client's starts at once, a request that times out while waiting gives up its place,
and nothing is held once every request is done."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tidal.app.compile_gate import CompileGate
from tidal.app.errors import ApiError
from tidal.app.handling import check_grammar
from tidal.core.lifecycle import Arrival
from tidal.core.sampling_params import SamplingParams
from tidal.core.structured_output import StructuredOutputsParams


class SlowCompiler:
    """``compile_grammar`` that finishes when the test says so, recording what started."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.done: dict[str, asyncio.Event] = {}

    async def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        self.started.append(spec.regex)
        await self.done.setdefault(spec.regex, asyncio.Event()).wait()


def _params(regex: str) -> SamplingParams:
    return SamplingParams(structured_outputs=StructuredOutputsParams(regex=regex))


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_clients_grammars_compile_one_at_a_time_and_others_do_not_wait():
    engine = SlowCompiler()
    state = SimpleNamespace(engine=engine, compile_gate=CompileGate())
    first = asyncio.create_task(check_grammar(state, _params("a+"), Arrival(client="x")))
    second = asyncio.create_task(check_grammar(state, _params("b+"), Arrival(client="x")))
    other = asyncio.create_task(check_grammar(state, _params("c+"), Arrival(client="y")))
    await _settle()
    assert engine.started == ["a+", "c+"]  # x's second waits; y's starts at once
    engine.done.setdefault("c+", asyncio.Event()).set()
    await other
    engine.done["a+"].set()
    await first
    await _settle()
    assert engine.started == ["a+", "c+", "b+"]
    engine.done["b+"].set()
    await second
    assert state.compile_gate.num_clients == 0


async def test_a_request_past_its_timeout_while_waiting_gives_up_its_place():
    engine = SlowCompiler()
    state = SimpleNamespace(engine=engine, compile_gate=CompileGate())
    first = asyncio.create_task(check_grammar(state, _params("a+"), Arrival(client="x")))
    await _settle()
    with pytest.raises(ApiError) as err:  # waits behind a+ until its 0.05 s run out
        await check_grammar(state, _params("b+"), Arrival(client="x", timeout=0.05))
    assert err.value.status == 408 and engine.started == ["a+"]
    engine.done["a+"].set()
    await first
    assert state.compile_gate.num_clients == 0
