"""The embeddings throughput benchmark's pieces on a tiny Qwen3-0.6B-shaped model: its texts
cut to the same token count, its sentence-transformers layout read as last-token pooling, and
tidal's side of a round, whose embeddings equal HF transformers' normalised last hidden
state (sentence-transformers' side where it is installed). No timing is asserted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from bench.embeddings_throughput import (
    SHAPE,
    make_texts,
    run_sentence_transformers,
    run_tidal,
    sentence_transformers_layout,
)
from bench.model_shapes import build_shaped_model_dir
from tidal.core.pooling import read_pooling_config

SEQ_LEN = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = build_shaped_model_dir(tmp_path_factory.mktemp("embed_bench") / "m", SHAPE,
                                  tiny=True, dtype=torch.float32)
    sentence_transformers_layout(path, 64, SEQ_LEN)
    return path


def test_tidal_round_embeds_as_hf_does(model: Path) -> None:
    assert read_pooling_config(model).method == "last"
    texts = make_texts(model, 3, SEQ_LEN)
    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = tokenizer(texts, truncation=True, max_length=SEQ_LEN)["input_ids"]
    assert {len(i) for i in ids} == {SEQ_LEN}
    out = run_tidal(str(model), texts, SEQ_LEN, "float32", "cpu", 1, None)
    assert len(out["rounds_s"]) == 1 and out["steps_per_round"] >= 1
    hf = AutoModel.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        last = hf(torch.tensor(ids)).last_hidden_state[:, -1]
    want = torch.nn.functional.normalize(last, dim=-1)
    torch.testing.assert_close(torch.tensor(out["embeddings"]), want, atol=1e-4, rtol=0)
    pytest.importorskip("sentence_transformers")
    st = run_sentence_transformers(str(model), texts, "float32", "cpu", 1)
    torch.testing.assert_close(torch.tensor(st["embeddings"]), want, atol=1e-4, rtol=0)
