"""Grammars never read a special token as text: the detokenizer drops special tokens, so a
token the grammar counted as a string's characters would vanish from the reply (a schema's
``minLength: 1`` string coming out as ``""``). A structural tag's own markers stay special
tokens the grammar can write (Harmony's ``<|channel|>`` ... ``<|call|>``)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from tests.device import on_test_device
from tidal.core.llm import LLM
from tidal.core.sampling_params import SamplingParams
from tidal.core.structured_output import StructuredOutputsParams
from tidal.core.structured_output.compiler import GrammarCompiler
from tidal.gpu.random_model import build_model_dir, build_tokenizer

HARMONY = ["<|channel|>", "<|message|>", "<|call|>"]
TOKENIZER = build_tokenizer(512)
TOKENIZER.add_tokens(HARMONY, special_tokens=True)  # special, yet not in all_special_ids
TOKENIZER.add_tokens(["<tool_call>"])  # an added token that is text
STOP = TOKENIZER.eos_token_id
ID = {t.content: i for i, t in TOKENIZER.added_tokens_decoder.items()}
# what the detokenizer drops (the stop token aside: the grammar ends with it)
SPECIAL = {i for i, t in TOKENIZER.added_tokens_decoder.items() if t.special} - {STOP}
NAME = {"type": "string", "minLength": 1, "maxLength": 12}


@pytest.fixture(scope="module")
def compiler():
    compiler = GrammarCompiler(TOKENIZER, len(TOKENIZER), [STOP])
    yield compiler
    compiler.shutdown()


def allowed(compiler: GrammarCompiler, spec: StructuredOutputsParams, prefix: list[int]
            ) -> set[int]:
    """The tokens ``spec``'s grammar allows after the tokens ``prefix``, read from the bitmask
    xgrammar's matcher fills."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiler.submit(spec).result())
    for token in prefix:
        assert matcher.accept_token(token), TOKENIZER.decode([token])
    bitmask = xgr.allocate_token_bitmask(1, len(TOKENIZER))
    matcher.fill_next_token_bitmask(bitmask)
    bits = (bitmask[0].unsqueeze(1) >> torch.arange(32)) & 1
    return set(bits.flatten()[:len(TOKENIZER)].nonzero().flatten().tolist())


def text(s: str) -> list[int]:
    return TOKENIZER.encode(s, add_special_tokens=False)


@pytest.mark.parametrize("spec, prefix", [
    (StructuredOutputsParams(json=NAME), '"'),
    (StructuredOutputsParams(json={"type": "object", "properties": {"name": NAME},
                                   "required": ["name"]}), '{"name": "'),
    (StructuredOutputsParams(json_object=True), '{"'),
    (StructuredOutputsParams(regex=r"[a-z<|>_]{1,12}"), ""),
    (StructuredOutputsParams(grammar='root ::= [^"]+'), "a"),
], ids=["string", "property", "json_object", "regex", "grammar"])
def test_where_a_grammar_takes_text_no_special_token_is_allowed(compiler, spec, prefix):
    ok = allowed(compiler, spec, text(prefix))
    assert ok & SPECIAL == set(), sorted(TOKENIZER.decode([i]) for i in ok & SPECIAL)
    assert text("a")[0] in ok and ID["<tool_call>"] in ok  # text, added or not, still is


def test_a_structural_tag_writes_its_special_markers_and_no_other(compiler):
    tag = {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<|channel|>commentary<|message|>",
        "content": {"type": "json_schema", "json_schema": NAME}, "end": "<|call|>"}}
    spec = StructuredOutputsParams(structural_tag=tag, field="tools")
    assert ID["<|channel|>"] in allowed(compiler, spec, [])
    header = [ID["<|channel|>"], *text("commentary"), ID["<|message|>"]]
    inside = allowed(compiler, spec, header + text('"'))
    assert inside & SPECIAL <= {ID[m] for m in HARMONY}  # the tag's own markers at most
    assert ID["<|system|>"] not in inside and ID["<|user|>"] not in inside
    assert ID["<|call|>"] in allowed(compiler, spec, header + text('"ab"'))


@pytest.mark.gpu
def test_logits_that_favour_a_special_token_still_give_a_valid_reply(tmp_path):
    """``<|system|>`` biased far above every other token: read as its ten characters, it
    would fill the string, which the reply would show as ``""``."""
    model = build_model_dir(tmp_path / "llama", "llama")
    llm = LLM(str(model), **on_test_device())
    system = llm.tokenizer.convert_tokens_to_ids("<|system|>")
    name = {"type": "string", "minLength": 1, "maxLength": 10}
    schema = {"type": "object", "properties": {"name": name}, "required": ["name"],
              "additionalProperties": False}
    params = SamplingParams(temperature=0.0, max_tokens=60, logit_bias={system: 100.0},
                            structured_outputs=StructuredOutputsParams(json=schema))
    out = llm.generate(["Speak:"], params)[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), schema)
    assert system not in out.token_ids
