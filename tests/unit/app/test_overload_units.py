"""Units of the overload defences (docs/robustness.md): the grammar size limits, the compile
time limit and its replacement workers, the compiled-grammar cache's byte bound, the
scheduler's round-robin waiting queue and the admission counter. The same defences against a
live server: ``test_overload_server.py``."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from tidal.app.admission import Admission
from tidal.app.errors import ApiError
from tidal.core.request import Request, RequestStatus
from tidal.core.sampling_params import SamplingParams
from tidal.core.structured_output import StructuredOutputsParams, limits
from tidal.core.structured_output.compiler import (
    STUCK_NICENESS,
    WORKER_NICENESS,
    GrammarCompiler,
    GrammarError,
)
from tidal.core.waiting_queue import FairQueue


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    from tidal.gpu.random_model import build_model_dir

    path = build_model_dir(tmp_path_factory.mktemp("overload") / "tiny", "llama")
    return AutoTokenizer.from_pretrained(path)


def _compiler(tokenizer: Any, **kwargs: Any) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], **kwargs)


def _deep(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


# -- grammar size limits -----------------------------------------------------------------------
@pytest.mark.parametrize("constraint", [
    {"json": _deep(450)},  # answered 500, RecursionError in key(), on the event loop
    {"json": {"enum": [f"v{i}" for i in range(50_000)]}},  # compiled 92 s
    {"json": {"type": "string", "maxLength": 20_000}},  # 18 s as a pattern
    {"json": {"type": "string", "pattern": "^[a-z]{0,20000}$"}},
    {"json": "[" * 900 + "]" * 900},  # too deep for the JSON parser itself
    {"regex": "[a-z]{1,99999}"},
    {"choice": [f"c{i}" for i in range(1001)]},
    {"grammar": "root ::= r0\n" + "\n".join(f'r{i} ::= "x" r{i + 1}' for i in range(1200))},
    {"structural_tag": {"structures": [_deep(40)], "triggers": ["<"]}},
])
def test_grammars_past_the_limits_are_refused_naming_the_field(constraint: dict) -> None:
    start = time.monotonic()
    with pytest.raises(GrammarError) as info:
        StructuredOutputsParams(**constraint, field="response_format")
    assert info.value.param == "response_format"
    assert info.value.code == "grammar_too_large" or "JSON" in str(info.value)
    assert time.monotonic() - start < 5  # found without compiling


def test_grammars_within_the_limits_pass_and_key_by_content() -> None:
    schema = _deep(30)  # 61 levels of JSON
    a = StructuredOutputsParams(json=schema)
    b = StructuredOutputsParams(json=json.dumps(schema))
    assert a.key() == b.key() and len(a.key()[1]) == 64  # a digest, not the schema's text
    StructuredOutputsParams(json={"enum": list(range(limits.MAX_ENUM_VALUES))})
    StructuredOutputsParams(regex=f"[a-z]{{0,{limits.MAX_REPEAT}}}")


# -- the compiler: time limit, workers, cache bytes ---------------------------------------------
def test_a_compile_past_its_time_limit_fails_and_a_worker_takes_its_place(
        tokenizer: Any) -> None:
    """One slow compile (here a sleep, as a C++ compile cannot be interrupted) fails at its
    time limit; a trivial grammar submitted meanwhile compiles at once on a replacement
    worker; the slow grammar then fails at once from the cache."""
    compiler = _compiler(tokenizer, workers=1, timeout=0.5)
    real = compiler._compile_kind
    niceness: dict[str, list[int]] = {}

    def compile_kind(spec: StructuredOutputsParams) -> Any:
        tid = threading.get_native_id()
        niceness.setdefault(spec.regex or "", []).append(os.getpriority(os.PRIO_PROCESS, tid))
        if spec.regex == "slow":
            time.sleep(3)
            niceness["slow"].append(os.getpriority(os.PRIO_PROCESS, tid))
        return real(spec)

    compiler._compile_kind = compile_kind  # type: ignore[method-assign]
    try:
        compiler.submit(StructuredOutputsParams(regex="warm")).result(timeout=60)
        start = time.monotonic()
        slow = compiler.submit(StructuredOutputsParams(regex="slow"))
        quick = compiler.submit(StructuredOutputsParams(regex="[0-9]+"))
        with pytest.raises(GrammarError) as info:
            slow.result(timeout=10)
        assert info.value.code == "grammar_too_complex" and info.value.param
        assert quick.result(timeout=10) is not None
        assert time.monotonic() - start < 2.5  # not after the slow one's 3 s
        again = compiler.submit(StructuredOutputsParams(regex="slow"))
        assert again.done() and compiler.num_timeouts == 1
        time.sleep(3)  # the stuck worker finishes and leaves: one worker again
        assert compiler._threads_alive == 1 and compiler._stuck == 0
        if sys.platform == "linux":  # compiles yield to serving; one past its limit most
            assert niceness["[0-9]+"] == [WORKER_NICENESS]
            assert niceness["slow"] == [WORKER_NICENESS, STUCK_NICENESS]
    finally:
        compiler.shutdown()


def test_the_grammar_cache_holds_its_byte_bound(tokenizer: Any) -> None:
    """A stream of distinct large schemas: the cache's charged bytes, and the compiled sizes
    of the grammars it holds, stay within its bound; the newest stay cached."""
    bound = 400_000
    compiler = _compiler(tokenizer, cache_bytes=bound)
    try:
        sizes = []
        for i in range(40):
            schema = {"type": "object", "required": ["k"], "properties": {
                "k": {"enum": [f"value-{i}-{j}" for j in range(400)]}}}
            compiled = compiler.submit(StructuredOutputsParams(json=schema)).result(timeout=60)
            sizes.append(compiled.memory_size_bytes)
            assert compiler.cache_size <= bound
            held = sum(f.result().memory_size_bytes for f in compiler._cache.values())
            assert held <= bound
        assert min(sizes) > 20_000  # large enough for the bound to bite
        assert 1 < compiler.num_cached < 40
        latest = StructuredOutputsParams(json={"type": "object", "required": ["k"],
                                               "properties": {"k": {"enum": [
                                                   f"value-39-{j}" for j in range(400)]}}})
        assert compiler.submit(latest).done()  # the newest is still cached
    finally:
        compiler.shutdown()


# -- the scheduler's waiting queue ------------------------------------------------------------
def _request(rid: str, client: str) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=4), client=client)


def test_waiting_queue_takes_clients_in_turn_and_resumed_requests_first() -> None:
    queue = FairQueue()
    for i in range(100):
        queue.append(_request(f"a{i}", "A"))
    queue.append(_request("b0", "B"))
    assert (len(queue), queue.num_clients, queue.max_per_client) == (101, 2, 100)
    assert [queue.popleft().request_id for _ in range(4)] == ["a0", "b0", "a1", "a2"]
    resumed = _request("r", "B")
    resumed.status = RequestStatus.PREEMPTED
    queue.appendleft(resumed)
    assert queue[0] is resumed and queue.popleft() is resumed
    late = _request("late", "A")
    queue.putback([late])  # a request whose grammar was compiling keeps its place
    assert queue[0] is late
    queue.remove(late)
    assert [r.request_id for r in queue][:2] == ["a3", "a4"] and len(queue) == 97

    single = FairQueue()  # one client: first come, first served
    for i in range(5):
        single.append(_request(f"x{i}", ""))
    assert [single.popleft().request_id for _ in range(5)] == [f"x{i}" for i in range(5)]
    assert not single and single.num_clients == 0


# -- admission ----------------------------------------------------------------------------------
def test_admission_bounds_the_server_and_each_client() -> None:
    adm = Admission(max_num_seqs=4, max_waiting_seqs=16)  # 20 in all, 12 for one client
    big = adm.admit("A", 200)  # alone on the server: admitted, however large
    with pytest.raises(ApiError) as info:
        adm.admit("B", 1)
    assert info.value.status == 429 and info.value.headers["Retry-After"]
    big.release()
    big.release()  # idempotent
    a = [adm.admit("A", 4) for _ in range(3)]
    with pytest.raises(ApiError, match="this client"):
        adm.admit("A", 4)  # 16 > 12 for one client
    b = adm.admit("B", 8)  # another client still finds room
    with pytest.raises(ApiError, match="busy"):
        adm.admit("C", 1)  # 21 > 20
    b.release()
    with pytest.raises(ApiError, match="this client"):
        adm.check_room("A")  # 12 held: no request of A's could get in, whatever its size
    adm.check_room("B")  # B could still send one sequence
    for ticket in a:
        ticket.release()
    assert adm.total == 0 and adm.by_client == {}
    adm.check_room("A")


def test_config_rejects_bad_grammar_settings(tmp_path: Path) -> None:
    from tidal.core.config import EngineConfig
    from tidal.gpu.random_model import build_model_dir

    model = build_model_dir(tmp_path / "m", "llama")
    with pytest.raises(ValueError, match="grammar_compile_workers"):
        EngineConfig(model=str(model), grammar_compile_workers=0)
    with pytest.raises(ValueError, match="grammar_compile_timeout"):
        EngineConfig(model=str(model), grammar_compile_timeout=0)


def test_cli_limit_flags_and_defaults() -> None:
    from tidal.app.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert (args.max_prompts_per_request, args.max_request_tokens, args.max_tools) == (
        256, 1 << 20, 128)
    assert (args.max_waiting_seqs, args.max_waiting_seqs_per_client, args.fair_share_by) == (
        512, None, "address")
    assert (args.grammar_compile_timeout, args.grammar_compile_workers,
            args.grammar_cache_bytes) == (15.0, 4, 256 << 20)
    args = build_parser().parse_args([
        "serve", "--max-waiting-seqs", "0", "--fair-share-by", "user",
        "--grammar-cache-bytes", "64MiB", "--grammar-compile-timeout", "2.5"])
    assert (args.max_waiting_seqs, args.fair_share_by, args.grammar_cache_bytes,
            args.grammar_compile_timeout) == (0, "user", 64 << 20, 2.5)


def test_large_bodies_are_screened_for_their_object_counts() -> None:
    """``app/body_screen.screen`` (run in a worker process on a server) refuses what the caps
    refuse, and passes the rest untouched."""
    from tidal.app.body_screen import screen

    many = orjson.dumps({"model": "m", "prompt": ["a"] * 300})
    assert screen(many, 256, 128)[2:] == ("prompt", "too_many_prompts")
    tools = orjson.dumps({"messages": [], "tools": [{"type": "function"}] * 129})
    assert screen(tools, 256, 128)[2:] == ("tools", "too_many_tools")
    deep = b"[" * 100_000 + b"]" * 100_000  # past orjson's own depth limit
    assert screen(b'{"prompt": ' + deep + b"}", 256, 128)[3] == "invalid_json"
    assert screen(orjson.dumps({"prompt": ["a"] * 256, "tools": []}), 256, 128) is None
    assert screen(orjson.dumps({"prompt": [1, 2, 3] * 1000}), 256, 128) is None  # one prompt
