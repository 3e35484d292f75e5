"""The engine's side of streaming: each request's ``RequestOutputCollector`` under a lagging
consumer, when ``AsyncEngine`` posts a step's outputs, and abort when the consumer goes away."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

from tidal.core.async_engine import AsyncEngine
from tidal.core.config import EngineConfig
from tidal.core.outputs import CompletionOutput, RequestOutput, RequestOutputCollector
from tidal.core.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tidal.gpu.random_model import build_model_dir

    return build_model_dir(tmp_path_factory.mktemp("async_engine") / "tiny", "llama")


def _engine_config(model_dir: Path) -> EngineConfig:
    return EngineConfig(model=str(model_dir), kv_cache_memory=4 << 20, max_num_seqs=16)


# -- the collector ----------------------------------------------------------------------------
def _delta(text: str, ids: list[int], logprob: float, reason: str | None = None
           ) -> RequestOutput:
    comp = CompletionOutput(0, text, list(ids), [{i: logprob} for i in ids], reason)
    return RequestOutput("r", None, [1, 2], [comp], finished=reason is not None)


async def test_collector_merges_deltas_for_a_lagging_consumer() -> None:
    collector = RequestOutputCollector()
    collector.put(_delta("a", [5], -0.5))
    collector.put(_delta("b", [6, 7], -1.0))
    collector.put(_delta("c", [8], -2.0, "length"))
    out = collector.get_nowait() or await collector.get()
    comp = out.outputs[0]
    assert (comp.text, comp.token_ids) == ("abc", [5, 6, 7, 8])
    assert comp.logprobs == [{5: -0.5}, {6: -1.0}, {7: -1.0}, {8: -2.0}]
    assert comp.finish_reason == "length" and out.finished
    assert collector.get_nowait() is None  # one slot: nothing queued behind the merge


async def test_collector_wakes_a_waiting_consumer_and_raises_errors() -> None:
    collector = RequestOutputCollector()
    waiter = asyncio.ensure_future(collector.get())
    await asyncio.sleep(0)
    collector.put(_delta("x", [3], -0.1))
    assert (await waiter).outputs[0].text == "x"
    collector.put(_delta("y", [4], -0.1))
    collector.put(RuntimeError("engine died"))
    with pytest.raises(RuntimeError, match="engine died"):
        collector.get_nowait()


async def test_lagging_consumer_of_a_real_engine_gets_merged_deltas(model_dir: Path) -> None:
    engine = AsyncEngine(_engine_config(model_dir))
    engine.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        deltas = []
        async for out in engine.generate([5, 6, 7, 8], params, "slow"):
            deltas.append(out)
            while engine.stats.num_running:  # lag until the engine has finished the request
                await asyncio.sleep(0.01)
        ids = [t for d in deltas for t in d.outputs[0].token_ids]
        assert len(ids) == 24 and len(deltas) <= 2  # everything after the first, merged
        assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "length"
        fast = [t async for d in engine.generate([5, 6, 7, 8], params, "fast")
                for t in d.outputs[0].token_ids]
        assert ids == fast
    finally:
        await engine.shutdown()


async def test_a_steps_outputs_are_posted_between_the_next_steps_inputs_and_forward(
        model_dir: Path) -> None:
    """The event loop streams while the model computes: the post never lands between a
    forward and the next step's input preparation, where it would take the GIL from it."""
    engine = AsyncEngine(_engine_config(model_dir))
    events: list[str] = []
    runner = engine.core.executor.runner

    def recorded(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            events.append(name)
            return fn(*args, **kwargs)
        return call

    runner._prepare_inputs = recorded("inputs", runner._prepare_inputs)
    runner.run_model = recorded("forward", runner.run_model)
    engine._call_loop = recorded("post", engine._call_loop)  # type: ignore[method-assign]
    engine.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        deltas = [d async for d in engine.generate([5, 6, 7, 8], params, "order")]
    finally:
        await engine.shutdown()
    assert sum(len(d.outputs[0].token_ids) for d in deltas) == 5 and deltas[-1].finished
    steps = "".join({"inputs": "i", "forward": "f", "post": "p"}[e] for e in events)
    # the last step's tokens are posted once no step follows (then a stats-only post or two)
    assert re.fullmatch(r"if(ipf){4}p+", steps), steps


async def test_cancelling_the_consumer_aborts_and_frees_blocks(model_dir: Path) -> None:
    engine = AsyncEngine(_engine_config(model_dir))
    engine.start()
    try:
        first = asyncio.Event()

        async def consume() -> None:
            params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
            async for _ in engine.generate(list(range(5, 45)), params, "gone"):
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        assert engine.stats.num_running == 1 and engine.stats.num_free_blocks < \
            engine.stats.num_total_blocks
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(500):  # the abort lands within one engine step
            if engine.stats.num_free_blocks == engine.stats.num_total_blocks:
                break
            await asyncio.sleep(0.01)
        stats = engine.stats
        assert stats.num_running == 0 and stats.num_waiting == 0
        assert stats.num_free_blocks == stats.num_total_blocks and stats.kv_cache_usage == 0.0
    finally:
        await engine.shutdown()


async def test_an_idle_engine_gives_its_steps_host_memory_back_once(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once per idle spell, after ``IDLE_RELEASE_S`` without work: never while it steps,
    never before its first step, never twice for one spell."""
    from tidal.core import async_engine

    monkeypatch.setattr(async_engine, "IDLE_RELEASE_S", 0.2)
    engine = AsyncEngine(_engine_config(model_dir))
    releases: list[int] = []
    engine.core.executor.release_host_memory = lambda: releases.append(1)  # type: ignore
    engine.start()
    try:
        await asyncio.sleep(0.5)
        assert releases == []  # no step ran yet: nothing to give back
        params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        for spell in (1, 2):
            tokens = [t async for d in engine.generate([5, 6, 7], params, f"r{spell}")
                      for t in d.outputs[0].token_ids]
            assert len(tokens) == 30 and len(releases) == spell - 1  # not while it served
            for _ in range(100):
                if len(releases) == spell:
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.5)
            assert len(releases) == spell
    finally:
        await engine.shutdown()
