"""The Ray executor (``distributed_executor_backend="ray"``) on one local Ray instance of two
CPUs: two rank actors (tensor-parallel ranks, or two pipeline stages with a micro-batch each in
flight) give the multiprocess executor's greedy tokens and logprobs under chunked prefill and
async scheduling (steps launched before the previous one's tokens are read); a killed actor
fails the engine loudly; shutdown leaves no actor, placement group or process behind; and
without Ray installed, asking for it names the extra to install."""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.hf_reference import reference_prompts
from tidal.core import LLM, SamplingParams
from tidal.core.config import EngineConfig
from tidal.core.executor import ExecutorFailedError
from tidal.gpu.random_model import build_model_dir

pytestmark = pytest.mark.slow  # Ray's start-up alone takes seconds

NEW_TOKENS = 12
TOL = 1e-5
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
# small steps (chunked prefill), the next step launched while one runs (async scheduling)
ENGINE = dict(dtype="float32", max_model_len=256, tensor_parallel_size=2,
              max_num_batched_tokens=48, max_num_seqs=4, async_scheduling=True,
              cpu_kernels="off", kv_cache_memory=8 << 20)  # no plans timed, a small cache


@pytest.fixture(scope="module")
def ray_session():
    """One Ray instance for the module: the executors join it (and leave it running)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("llama"), "llama", num_attention_heads=4,
                           num_key_value_heads=2)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _assert_nothing_left(ray: Any, pids: list[int]) -> None:
    assert not [p for p in pids if _alive(p)], "a rank's process outlived the engine"
    groups = ray.util.placement_group_table().values()
    assert all(g["state"] == "REMOVED" for g in groups), groups
    deadline = time.monotonic() + 10  # Ray gives the group's CPUs back shortly after
    while ray.available_resources().get("CPU") != 2.0:
        assert time.monotonic() < deadline, "the ranks' CPUs were not given back"
        time.sleep(0.1)


def test_ray_ranks_give_the_multiprocess_tokens(ray_session, model):
    """Two tensor-parallel ranks, then two pipeline stages with a micro-batch each in
    flight, as actors: the multiprocess executor's tokens."""
    prompts = reference_prompts(5)[:5]
    outputs = {}
    stages = {**ENGINE, "tensor_parallel_size": 1, "pipeline_parallel_size": 2}
    for name, backend, args in (("mp", "mp", ENGINE), ("ray", "ray", ENGINE),
                                ("ray stages", "ray", stages)):
        llm = LLM(str(model), distributed_executor_backend=backend, **args)
        try:
            outputs[name] = llm.generate(prompts, GREEDY, use_tqdm=False)
        finally:
            llm.shutdown()
        if backend == "ray":
            ranks = llm.engine.executor.workers
            assert [h.rank for h in ranks] == [0, 1]
            _assert_nothing_left(ray_session, [h.pid for h in ranks])
    assert llm.engine.executor.max_steps_in_flight == 2
    for want, got in [*zip(outputs["mp"], outputs["ray"]),
                      *zip(outputs["mp"], outputs["ray stages"])]:
        a, b = want.outputs[0], got.outputs[0]
        assert b.token_ids == a.token_ids
        for ref_lp, got_lp in zip(a.logprobs, b.logprobs):
            assert ref_lp.keys() == got_lp.keys()
            assert all(abs(got_lp[t] - v) <= TOL for t, v in ref_lp.items())


def test_a_killed_actor_fails_the_engine_and_nothing_is_left(ray_session, model):
    llm = LLM(str(model), distributed_executor_backend="ray", **ENGINE)
    executor = llm.engine.executor
    failed: list[BaseException] = []
    noticed = threading.Event()
    executor.on_failure = lambda exc: (failed.append(exc), noticed.set())
    pids = [h.pid for h in executor.workers]
    try:
        assert len(llm.generate("hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 12
        os.kill(pids[1], signal.SIGKILL)  # between steps: the watcher sees it
        assert noticed.wait(30), "the engine was not told of the dead rank"
        assert isinstance(failed[0], ExecutorFailedError)
        assert "rank 1" in str(failed[0]), failed[0]
        with pytest.raises(ExecutorFailedError):
            llm.generate("hello", GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    _assert_nothing_left(ray_session, pids)
    assert ray_session.is_initialized(), "the caller's Ray session should be left as it was"


def test_ray_without_ray_installed_names_the_extra(model, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ray" else find_spec(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'tidal\[ray\]'"):
        EngineConfig(str(model), distributed_executor_backend="ray")
