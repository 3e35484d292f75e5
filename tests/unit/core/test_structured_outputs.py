"""Constrained decoding in the engine: every sample parses and validates, the free requests
beside constrained ones keep their tokens, and preemption and aborts leave no matcher behind."""

from __future__ import annotations

import functools
import json
import random
import re
from concurrent.futures import Future

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings

from tests.device import on_test_device
from tests.marks import quick_only
from tests.unit.core.test_scheduler import run_workload, workload
from tidal.core.config import DEFAULT_MODEL
from tidal.core.kv_cache_manager import KVCacheManager
from tidal.core.llm import LLM
from tidal.core.request import Request, RequestStatus
from tidal.core.sampling_params import SamplingParams
from tidal.core.scheduler import Scheduler, SchedulerConfig
from tidal.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from tidal.core.structured_output import StructuredOutputsParams
from tidal.core.structured_output.compiler import JSON_CHAR, GrammarError, bounded_strings
from tidal.core.structured_output.manager import StructuredOutputManager
from tidal.gpu.random_model import build_model_dir, build_tokenizer

pytestmark = pytest.mark.gpu

NUM_SAMPLES = 50
# nested objects, arrays, enums and required fields; every string and array bounded, so a
# sample at temperature 1 ends well within max_tokens
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "level": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"type": "string", "enum": ["knight", "fool", "king"]},
        "home": {"type": "object",
                 "properties": {"city": {"type": "string", "maxLength": 10},
                                "port": {"type": "boolean"}},
                 "required": ["city"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                 "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "kind", "home", "tags"],
    "additionalProperties": False,
}
REGEX = r"(Sir|Lady) [A-Z][a-z]{1,8} of [A-Z][a-z]{2,8}"
CHOICES = ["To be", "not to be", "that is the question"]


@pytest.fixture(scope="module")
def random_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("so") / "llama", "llama",
                           max_position_embeddings=1024)


@pytest.fixture(scope="module", params=["embedded", "random"])
def llm(request, random_dir):
    return LLM(DEFAULT_MODEL if request.param == "embedded" else str(random_dir),
               **on_test_device())


def _samples(llm: LLM, spec: StructuredOutputsParams, max_tokens: int = 200) -> list:
    params = SamplingParams(n=NUM_SAMPLES, temperature=1.0, seed=7, max_tokens=max_tokens,
                            structured_outputs=spec)
    return llm.generate(["Speak:"], params)[0].outputs


def test_json_schema_samples_all_parse_and_validate(llm):
    for out in _samples(llm, StructuredOutputsParams(json=SCHEMA)):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_regex_and_choice_samples_all_match(llm):
    for out in _samples(llm, StructuredOutputsParams(regex=REGEX)):
        assert re.fullmatch(REGEX, out.text), out.text
    texts = {out.text for out in _samples(llm, StructuredOutputsParams(choice=CHOICES))}
    assert texts <= set(CHOICES) and len(texts) > 1  # temperature 1 picks more than one


def test_json_object_samples_that_end_all_parse(llm):
    """Any JSON object: strings are unbounded, so a sample may run into max_tokens; every one
    that ends by the grammar parses into an object."""
    outs = _samples(llm, StructuredOutputsParams(json_object=True), max_tokens=240)
    ended = [o for o in outs if o.finish_reason == "stop"]
    # enough to check: of 50 samples from the embedded model 19 ended on the CPU, 11 on an H200
    assert len(ended) >= NUM_SAMPLES // 5
    for out in ended:
        assert isinstance(json.loads(out.text), dict)
    for out in outs:
        assert out.text.startswith("{")


TOOL_SCHEMA = {"type": "object",
               "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 10},
                              "days": {"type": "integer", "minimum": 1, "maximum": 7}},
               "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": TOOL_SCHEMA}},
         {"type": "function", "function": {"name": "search", "parameters": SCHEMA}}]


@pytest.mark.parametrize("parser_name", quick_only(["hermes", "llama3_json", "mistral"], "hermes"))
@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_forced_tool_call_samples_all_parse_and_validate(llm, parser_name, choice):
    from tidal.app.tool_parsers import get_parser

    parser = get_parser(parser_name)
    tag = parser.structural_tag(TOOLS, choice, False)
    spec = StructuredOutputsParams(structural_tag=tag, field="tools")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for out in _samples(llm, spec, max_tokens=240):
        assert out.finish_reason == "stop", out.text
        reply = parser.extract(out.text)
        assert len(reply.tool_calls) == 1 and not reply.content, out.text
        call = reply.tool_calls[0]
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_async_scheduling_gives_the_same_constrained_tokens(random_dir):
    """With async scheduling a step is launched before the last one's tokens are known; a
    step with constrained rows takes them first, so every matcher advances in order."""
    params = SamplingParams(temperature=0.0, max_tokens=120,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    prompts = ["Once upon a time", "The king said", "Hello there", "Speak:"]
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    runs = []
    for async_scheduling in (False, True):
        llm = LLM(str(random_dir), async_scheduling=async_scheduling, **on_test_device())
        outs = llm.generate(prompts + prompts, [params] * 4 + [free] * 4)
        runs.append([o.outputs[0].token_ids for o in outs])
    assert runs[0] == runs[1]


def test_greedy_constrained_is_deterministic_and_free_rows_keep_their_tokens(random_dir):
    llm = LLM(str(random_dir), **on_test_device())
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    # SCHEMA's strings hold at most 40 characters: even as six-character escapes of a token
    # each, the object ends within 400 tokens
    constrained = SamplingParams(temperature=0.0, max_tokens=400,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    prompts = ["Once upon a time", "The king said", "Hello there"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free)]
    mixed = llm.generate(prompts + prompts, [free] * 3 + [constrained] * 3)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    texts = [o.outputs[0].text for o in mixed[3:]]
    for out in mixed[3:]:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    again = llm.generate(prompts, constrained)
    assert [o.outputs[0].text for o in again] == texts


def test_a_grammar_that_does_not_compile_fails_only_its_request(random_dir):
    llm = LLM(str(random_dir), **on_test_device())
    bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
        regex="(unclosed", field="structured_outputs.regex"))
    good = SamplingParams(max_tokens=8, temperature=0.0)
    core = llm.engine
    core.add_request("bad", [1, 2, 3], bad)
    core.add_request("good", [1, 2, 3], good)
    outputs = {}
    while core.has_unfinished_requests():
        for out in core.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert outputs["bad"][-1].outputs[0].finish_reason == "error"
    assert "structured_outputs.regex" in (outputs["bad"][-1].error or "")
    assert len(sum((o.outputs[0].token_ids for o in outputs["good"]), [])) == 8
    assert core.structured.num_live == 0


def test_bounded_strings_get_a_pattern_of_the_same_lengths():
    schema = bounded_strings({"type": "array", "items": {"type": "string", "maxLength": 3}})
    assert schema["items"] == {"type": "string", "pattern": f"^{JSON_CHAR}{{0,3}}$"}
    keep = {"type": "string", "maxLength": 3, "enum": ["a"]}
    assert bounded_strings(keep) == keep


def test_bounded_strings_hold_only_what_json_strings_may_hold_unescaped():
    manager = StructuredOutputManager(TOKENIZER, 512, [TOKENIZER.eos_token_id])
    spec = StructuredOutputsParams(json={"type": "string", "maxLength": 3})
    compiled = manager.compiler.submit(spec).result()
    import xgrammar as xgr

    def accepts(value: bytes) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return bool(matcher.accept_string(b'"' + value + b'"') and matcher.is_completed())

    # control characters, quote, backslash, overlong forms, surrogates, past U+10FFFF
    for bad in [b"\x01", b"\t", b'"', b"\\", b"\xc0\xaf", b"\xe0\x98\x80", b"\xed\xa8\xb0",
                b"\xf0\x80\x80\x80", b"\xf4\x90\x80\x80", b"\xff", b"abcd"]:
        assert not accepts(bad), bad
    for good in ["abc", "日本語", "é", "😀", "\U0010ffff", "\ue000", " ~"]:
        assert accepts(good.encode()), good


def test_spec_needs_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])


# -- the scheduler with constrained requests, driven without a model ---------------------------
TOKENIZER = build_tokenizer(512)
SCHED_REGEX = r"[a-z]{1,6}( [a-z]{1,6}){0,3}"


def _allowed_token(manager: StructuredOutputManager, req_id: str, rng: random.Random) -> int:
    mask = manager.bitmask([req_id])
    assert mask is not None
    bits = np.unpackbits(mask.bitmask[0].view(np.uint8), bitorder="little")[:512]
    return int(rng.choice(np.flatnonzero(bits)))


@functools.cache
def _shared_manager() -> StructuredOutputManager:
    return StructuredOutputManager(TOKENIZER, 512, [TOKENIZER.eos_token_id])


@settings(max_examples=25, deadline=None)
@given(workload)
def test_random_constrained_workload_leaks_no_matcher_or_block(w):
    rng = random.Random(w["seed"])
    kv = KVCacheManager(w["num_blocks"], w["block_size"], enable_caching=w["caching"])
    manager = _shared_manager()  # every example ends with no matcher held
    config = SchedulerConfig(w["max_num_seqs"], w["budget"], max_model_len=64,
                             attention_cost_context=w["attention_cost_context"])
    scheduler = Scheduler(config, kv, manager)
    spec = StructuredOutputsParams(regex=SCHED_REGEX)
    requests = []
    for i in range(w["num_requests"]):
        constrained = rng.random() < 0.5
        params = SamplingParams(max_tokens=rng.randint(1, 20),
                                structured_outputs=spec if constrained else None)
        prompt = [rng.randrange(50) for _ in range(rng.randint(1, 30))]
        requests.append(Request(str(i), prompt, params, eos_token_id=TOKENIZER.eos_token_id))
    def forward(out: SchedulerOutput) -> ModelRunnerOutput:
        if out.is_empty:  # as the engine does: wait for a grammar rather than spin
            manager.wait_for_compiles(1.0)
        ids, tokens = [], []
        for req_id in out.num_scheduled_tokens:
            request = scheduler.requests[req_id]
            if request.num_computed_tokens >= request.num_tokens:
                ids.append(req_id)
                tokens.append(_allowed_token(manager, req_id, rng)
                              if req_id in out.structured_req_ids else rng.randrange(512))
        return ModelRunnerOutput(ids, [[t] for t in tokens])

    run_workload(scheduler, list(requests), rng, w["abort_rate"], forward)
    assert all(r.is_finished for r in requests)
    assert manager.num_live == 0
    assert kv.pool.num_free_blocks == kv.num_blocks
    for r in requests:
        if r.sampling_params.structured_outputs is not None and r.stop_reason is None \
                and r.status == RequestStatus.FINISHED_STOPPED:
            text = TOKENIZER.decode(r.output_token_ids, skip_special_tokens=True)
            assert re.fullmatch(SCHED_REGEX, text), text


def test_a_request_waits_for_its_grammar_without_holding_up_others():
    kv = KVCacheManager(32, 4)
    manager = StructuredOutputManager(TOKENIZER, 512, [TOKENIZER.eos_token_id])
    gate: Future = Future()
    manager.compiler.submit = lambda spec: gate  # a compile that has not finished
    scheduler = Scheduler(SchedulerConfig(4, 64, 64), kv, manager)
    slow = Request("slow", [1, 2, 3], SamplingParams(
        max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a+")))
    fast = Request("fast", [4, 5, 6], SamplingParams(max_tokens=4))
    scheduler.add_request(slow)
    scheduler.add_request(fast)
    assert slow.status == RequestStatus.WAITING_FOR_GRAMMAR
    out = scheduler.schedule()
    assert list(out.num_scheduled_tokens) == ["fast"]
    assert list(scheduler.waiting) == [slow]
    gate.set_exception(GrammarError("structured_outputs.regex does not compile: x",
                                    "structured_outputs.regex"))
    scheduler.schedule()
    assert slow.status == RequestStatus.FINISHED_ERROR
    assert scheduler.take_grammar_failures() == [slow]
    assert manager.num_live == 0
