"""Beam search returns HF transformers' beams and scores (``generate(num_beams=...)``) on the
same random weights (core/beam_search.py, ``LLM.beam_search``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.marks import quick_only
from tidal.core.beam_search import BeamSearch, BeamSearchParams
from tidal.core.llm import LLM
from tidal.gpu.random_model import build_model_dir

PROMPTS = [[5, 17, 42, 99, 3, 250, 77, 31, 8, 64, 200, 11, 13, 90, 150, 2, 19, 400, 21, 6],
           [300, 12, 7]]


def _hf_beams(hf, prompt: list[int], width: int, max_tokens: int, length_penalty: float,
              early_stopping: bool | str) -> list[tuple[list[int], float]]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                        dtype=torch.long),
                      num_beams=width, num_return_sequences=width, max_new_tokens=max_tokens,
                      length_penalty=length_penalty, early_stopping=early_stopping,
                      do_sample=False, output_scores=True, return_dict_in_generate=True)
    eos = hf.generation_config.eos_token_id
    beams = []
    for seq, score in zip(out.sequences.tolist(), out.sequences_scores.tolist()):
        tokens = seq[len(prompt):]
        if eos is not None and eos in tokens:  # the padding after an early end
            tokens = tokens[:tokens.index(eos) + 1]
        beams.append((tokens, score))
    return beams


def _model(tmp_path: Path, arch: str, eos: int | None) -> tuple[str, AutoModelForCausalLM]:
    path = build_model_dir(tmp_path / arch, arch)
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = eos
    (path / "config.json").write_text(json.dumps(config))
    gen = path / "generation_config.json"
    if gen.exists():
        gen.unlink()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.generation_config.eos_token_id = eos
    hf.generation_config.pad_token_id = eos if eos is not None else 0
    return str(path), hf


@pytest.mark.parametrize("arch", quick_only(["llama", "qwen3"], "qwen3"))
def test_beams_and_scores_equal_hf(tmp_path: Path, arch: str) -> None:
    path, hf = _model(tmp_path, arch, eos=None)
    # an end-of-sequence token the beams meet early: the first beam's third token
    eos = _hf_beams(hf, PROMPTS[0], 3, 4, 1.0, False)[0][0][2]
    path, hf = _model(tmp_path / "eos", arch, eos=eos)
    llm = LLM(path, kv_cache_memory=8 << 20, max_num_seqs=16)
    cases = [(3, 6, 1.0, False), (4, 5, 0.5, True), (2, 7, 2.0, "never")]
    reasons = set()
    for width, max_tokens, penalty, early in cases:
        params = BeamSearchParams(width, max_tokens, length_penalty=penalty,
                                  early_stopping=early)
        ours = llm.beam_search(PROMPTS, params)
        for prompt, found in zip(PROMPTS, ours):
            want = _hf_beams(hf, prompt, width, max_tokens, penalty, early)
            assert [b.tokens for b in found] == [t for t, _ in want], (width, prompt)
            for beam, (_, score) in zip(found, want):
                assert beam.score == pytest.approx(score, abs=1e-4)
                reasons.add(beam.finish_reason)
    assert reasons == {"stop", "length"}, "some beams end on the EOS, some at the length"
    assert llm.engine.kv.stats.hits > 0, "beams read their shared prefix from the cache"


def test_the_search_stops_where_no_running_beam_can_win() -> None:
    """Two finished hypotheses, [0] at -1 / 1 and [3, 0] at -1.1 / 2; the best running beam's
    -5 / 2 cannot beat the worse of them, so the search ends (length penalty 1)."""
    search = BeamSearch([1], BeamSearchParams(2, 10), eos_token_ids=[0])
    search.advance([{0: -1.0, 3: -1.0, 4: -5.0, 5: -6.0}])
    assert not search.done and len(search.finished) == 1
    search.advance([{0: -0.1, 7: -4.0, 8: -5.0, 9: -6.0}, {0: -1.0, 7: -9.0, 8: -9.5, 9: -9.9}])
    assert search.done
    assert [b.tokens for b in search.results()] == [[3, 0], [0]]
    assert [b.score for b in search.results()] == pytest.approx([-0.55, -1.0])
    assert [b.finish_reason for b in search.results()] == ["stop", "stop"]


def test_bad_params_are_refused() -> None:
    for kwargs in ({"beam_width": 0, "max_tokens": 3}, {"beam_width": 11, "max_tokens": 3},
                   {"beam_width": 2, "max_tokens": 0},
                   {"beam_width": 2, "max_tokens": 3, "early_stopping": "sometimes"}):
        with pytest.raises(ValueError):
            BeamSearchParams(**kwargs)
