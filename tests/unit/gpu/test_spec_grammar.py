"""Structured outputs with speculative decoding: a constrained request's proposals are cut to
what its grammar allows, each proposed position is verified under its own bitmask, and the
matcher holds only accepted tokens afterwards. Greedy keeps the tokens of a run without
proposals; samples at temperature 1 all parse and validate."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest

from tests.device import on_test_device
from tests.unit.core.test_structured_outputs import SCHEMA, TOOLS
from tests.unit.gpu.test_spec_decode import (  # noqa: F401 - a fixture
    SPEC,
    _prompts,
    echo_model,
    speculating,
)
from tidal.core import LLM, SamplingParams
from tidal.core.request import Request
from tidal.core.structured_output import StructuredOutputsParams
from tidal.core.structured_output.manager import StructuredOutputManager
from tidal.gpu.random_model import build_tokenizer

pytest.importorskip("xgrammar")

TOKENIZER = build_tokenizer(512)
WORDS = r"([a-z]{1,8} ){3,12}[a-z]{1,8}\."  # bounded: ends within 117 characters


def _bits(bitmask: np.ndarray) -> np.ndarray:
    return np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:512]


def _ready(manager: StructuredOutputManager, req_id: str, regex: str) -> Request:
    request = Request(req_id, [1, 2], SamplingParams(
        structured_outputs=StructuredOutputsParams(regex=regex)))
    manager.add(request)
    manager.wait_for_compiles(30.0)
    assert manager.resolve(request) is True
    return request


def test_proposals_are_cut_where_the_grammar_refuses_and_rows_follow_each_proposal():
    manager = StructuredOutputManager(TOKENIZER, 512, [TOKENIZER.eos_token_id])
    _ready(manager, "r", WORDS)
    _ready(manager, "fresh", WORDS)
    rng = random.Random(0)
    accepted: list[int] = []
    for _ in range(6):  # walk the grammar, each time proposing an allowed run then a refusal
        run = []
        for _ in range(3):
            bits = _bits(manager.bitmask(["fresh"]).bitmask[0])
            run.append(int(rng.choice(np.flatnonzero(bits))))
            manager.accept("fresh", run[-1])
        refused = int(np.flatnonzero(_bits(manager.bitmask(["fresh"]).bitmask[0]) == 0)[0])
        manager._matchers["fresh"].rollback(3)
        drafts = manager.allowed_prefix("r", run + [refused, run[0]])
        assert drafts == run
        rows = manager.bitmask(["r"], {"r": drafts})
        assert rows.num_rows == [4] and rows.bitmask.shape[0] == 4
        for j in range(4):  # row j: what a fresh matcher allows after the first j proposals
            want = manager.bitmask(["fresh"]).bitmask[0]
            assert np.array_equal(rows.bitmask[j], want)
            if j < 3:
                manager.accept("fresh", drafts[j])
        manager._matchers["fresh"].rollback(3)
        # the matcher was rolled back: it equals one fed only the accepted tokens
        keep = rng.randint(0, 3)
        for token_id in drafts[:keep]:
            manager.accept("r", token_id)
            manager.accept("fresh", token_id)
        accepted += drafts[:keep]
        assert np.array_equal(manager.bitmask(["r"]).bitmask[0],
                              manager.bitmask(["fresh"]).bitmask[0])
    assert accepted  # the walk moved


@pytest.mark.gpu
def test_greedy_constrained_with_proposals_keeps_its_tokens(echo_model):  # noqa: F811
    args = on_test_device(dtype="float32", max_num_seqs=4)
    free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    words = SamplingParams(temperature=0.0, max_tokens=130,
                           structured_outputs=StructuredOutputsParams(regex=WORDS))
    prompts = _prompts()[1:]
    params = [free] * 3 + [words] * 3
    plain = LLM(echo_model, **args).generate(prompts * 2, params, use_tqdm=False)
    spec = LLM(echo_model, speculative_config=SPEC, **args)
    got = spec.generate(prompts * 2, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    for out in got[3:]:
        assert out.outputs[0].finish_reason == "stop"
        assert re.fullmatch(WORDS, out.outputs[0].text), out.outputs[0].text
    alone = speculating(LLM(echo_model, speculative_config=SPEC, **args))
    alone.generate(prompts, words, use_tqdm=False)  # constrained rows only: they speculate
    assert alone.engine.stats().spec_decode_num_accepted_tokens >= 10


@pytest.mark.gpu
def test_sampled_constrained_outputs_with_proposals_all_validate(echo_model):  # noqa: F811
    from tidal.app.tool_parsers import get_parser

    # async scheduling off (a GPU's default is on): with it, a seeded sampled request never
    # speculates, since which steps speculate, and so its draws, would vary from run to run
    spec = speculating(LLM(echo_model, speculative_config=SPEC,
                           **on_test_device(dtype="float32", async_scheduling=False)))

    def samples(constraint: StructuredOutputsParams) -> list:
        params = SamplingParams(n=50, temperature=1.0, seed=11, max_tokens=240,
                                structured_outputs=constraint)
        return spec.generate([_prompts()[2]], params, use_tqdm=False)[0].outputs

    for out in samples(StructuredOutputsParams(json=SCHEMA)):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    parser = get_parser("hermes")
    forced = {"type": "function", "function": {"name": "get_weather"}}
    tag = parser.structural_tag(TOOLS, forced, False)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for out in samples(StructuredOutputsParams(structural_tag=tag, field="tools")):
        assert out.finish_reason == "stop", out.text
        reply = parser.extract(out.text)
        assert len(reply.tool_calls) == 1 and not reply.content, out.text
        call = reply.tool_calls[0]
        assert call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    assert spec.engine.stats().spec_decode_num_draft_tokens > 0
