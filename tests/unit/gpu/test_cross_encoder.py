"""Sequence classifiers (cross-encoders, ``runner="pooling"``): a random tiny
``LlamaForSequenceClassification``, ``Qwen2ForSequenceClassification`` and
``Qwen3ForSequenceClassification`` of one label score each prompt as HF transformers'
``AutoModelForSequenceClassification`` does, the sigmoid of its logit (sentence-transformers'
``CrossEncoder`` default), alone and in a batch; several labels give the softmax."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from tests.device import TEST_DEVICE
from tests.hf_reference import fidelity_llm
from tidal.core.pooling import read_pooling_config
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.random_model import build_model_dir

pytestmark = pytest.mark.gpu

# different lengths, one over two 16-token chunks; none holds the padding id (1)
PROMPTS = [[5 + (7 * i) % 300 for i in range(37)], [11, 12, 13], [200 + i for i in range(9)]]
KV = 4 << 20


@torch.no_grad()
def hf_probs(path: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """HF's label probabilities of each prompt, run alone."""
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    hf = hf.to(TEST_DEVICE).eval()
    logits = [hf(torch.tensor([p], device=TEST_DEVICE)).logits[0].cpu() for p in prompts]
    return [torch.sigmoid(x) if x.numel() == 1 else torch.softmax(x, -1) for x in logits]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_one_label_scores_match_hf_alone_and_in_a_batch(arch: str, tmp_path: Path) -> None:
    path = build_model_dir(tmp_path / arch, arch, num_labels=1)
    config = read_pooling_config(path)
    assert (config.method, config.normalize, config.labels) == ("last", False, ("LABEL_0",))
    assert ModelConfig.load(path).num_labels == 1
    llm = fidelity_llm(str(path), runner="pooling", max_num_batched_tokens=16,
                       kv_cache_memory=KV, max_num_seqs=4)
    batch = [o.outputs.embedding for o in llm.embed(PROMPTS, use_tqdm=False)]
    for ref, got in zip(hf_probs(path, PROMPTS), batch):
        assert len(got) == 1
        torch.testing.assert_close(torch.tensor(got), ref, atol=1e-5, rtol=0)
    alone = llm.embed(PROMPTS[0], use_tqdm=False)[0].outputs.embedding  # chunked, by itself
    assert alone == pytest.approx(batch[0], abs=1e-6)


def test_several_labels_give_the_softmax(tmp_path: Path) -> None:
    path = build_model_dir(tmp_path / "three", "qwen3", num_labels=3)
    assert read_pooling_config(path).labels == ("LABEL_0", "LABEL_1", "LABEL_2")
    llm = fidelity_llm(str(path), runner="pooling", kv_cache_memory=KV, max_num_seqs=4)
    got = [o.outputs.embedding for o in llm.embed(PROMPTS[1:], use_tqdm=False)]
    for ref, probs in zip(hf_probs(path, PROMPTS[1:]), got):
        torch.testing.assert_close(torch.tensor(probs), ref, atol=1e-5, rtol=0)
