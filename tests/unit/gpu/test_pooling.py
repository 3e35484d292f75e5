"""Pooled embeddings (``runner="pooling"``, ``LLM.embed``) equal HF transformers' ``AutoModel``
hidden states on the same weights, pooled and normalised in torch: last-token and mean
pooling, in a batch of different lengths, with chunked prefill and a prefix-cache hit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModel

from tests.device import TEST_DEVICE
from tests.hf_reference import fidelity_llm
from tidal.core import LLM, SamplingParams
from tidal.core.pooling import read_pooling_config
from tidal.gpu.random_model import build_model_dir

pytestmark = pytest.mark.gpu

# different lengths, over several 16-token chunks; the last repeats the first (a prefix hit)
PROMPTS = [[5 + (7 * i) % 300 for i in range(40)], [11, 12, 13], [200 + i for i in range(23)]]
PROMPTS.append(PROMPTS[0])
KV = 4 << 20  # bytes of KV cache: a few blocks


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("pool") / "qwen3", "qwen3")


@pytest.fixture(scope="module")
def headless_mean_dir(qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same body saved as ``Qwen3Model`` (no head, weights without the ``model.``
    prefix, as Qwen3-Embedding ships), with sentence-transformers files asking for mean
    pooling and normalisation."""
    path = tmp_path_factory.mktemp("pool") / "qwen3_mean"
    AutoModel.from_pretrained(qwen3_dir, dtype=torch.float32).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (qwen3_dir / name).is_file():
            (path / name).write_bytes((qwen3_dir / name).read_bytes())
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False,
         "pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}))
    return path


@torch.no_grad()
def hf_embeddings(path: Path, prompts: list[list[int]], method: str) -> list[torch.Tensor]:
    hf = AutoModel.from_pretrained(path, dtype=torch.float32).to(TEST_DEVICE).eval()
    out = []
    for prompt in prompts:
        hidden = hf(torch.tensor([prompt], device=TEST_DEVICE)).last_hidden_state[0].cpu()
        pooled = hidden[-1] if method == "last" else hidden.mean(dim=0)
        out.append(torch.nn.functional.normalize(pooled, dim=-1))
    return out


def check(llm: LLM, path: Path, method: str, prompts: list[list[int]] = PROMPTS) -> None:
    got = llm.embed(prompts, use_tqdm=False)
    assert [o.prompt_token_ids for o in got] == prompts
    for ref, out in zip(hf_embeddings(path, prompts, method), got):
        vector = torch.tensor(out.outputs.embedding)
        assert vector.shape == ref.shape
        torch.testing.assert_close(vector, ref, atol=1e-4, rtol=0)


def test_last_token_pooling_matches_hf_with_chunks_and_a_prefix_hit(qwen3_dir: Path) -> None:
    llm = fidelity_llm(str(qwen3_dir), runner="pooling", max_num_batched_tokens=16,
                       kv_cache_memory=KV, max_num_seqs=4)
    check(llm, qwen3_dir, "last")
    assert llm.engine.kv.stats.hits >= 32  # the repeated prompt's two full blocks
    one_block_and_one = [list(range(40, 57))]
    check(llm, qwen3_dir, "last", one_block_and_one)
    check(llm, qwen3_dir, "last", one_block_and_one)  # cached: a step of its last token alone
    with pytest.raises(ValueError, match="--runner pooling"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)


def test_mean_pooling_of_a_headless_model_matches_hf(headless_mean_dir: Path) -> None:
    assert read_pooling_config(headless_mean_dir).method == "mean"
    llm = fidelity_llm(str(headless_mean_dir), runner="pooling", max_num_batched_tokens=16,
                       kv_cache_memory=KV, max_num_seqs=4)
    assert not llm.engine.kv.enable_caching  # every position must run for the mean
    check(llm, headless_mean_dir, "mean")


def test_pooling_config_from_sentence_transformers_files(tmp_path: Path) -> None:
    assert read_pooling_config(tmp_path).method == "last"  # no files: Qwen3-Embedding's
    (tmp_path / "modules.json").write_text(json.dumps(
        [{"path": "p", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    config = read_pooling_config(tmp_path)
    assert (config.method, config.normalize) == ("cls", True)
    (tmp_path / "modules.json").write_text("{not json")
    with pytest.raises(ValueError, match="modules.json"):
        read_pooling_config(tmp_path)


def test_a_generating_engine_refuses_embed(qwen3_dir: Path) -> None:
    llm = fidelity_llm(str(qwen3_dir), max_num_seqs=2, kv_cache_memory=KV)
    with pytest.raises(ValueError, match="--runner generate"):
        llm.embed("hello", use_tqdm=False)
