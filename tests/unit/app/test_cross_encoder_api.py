"""``/v1/score``, ``/v1/rerank`` and ``/v1/classify`` on a ``--runner pooling`` server whose
model is a tiny random ``Qwen3ForSequenceClassification`` (a cross-encoder): each (query,
document) pair is the tokenizer's pair encoding, scored as HF transformers'
``AutoModelForSequenceClassification`` scores it (the sigmoid of its logit)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from starlette.testclient import TestClient
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from tidal.app.routes import build_app
from tidal.app.server_state import ServerSettings
from tidal.core.async_engine import AsyncEngine
from tidal.core.config import EngineConfig

QUERY = "the quick brown fox"
DOCS = ["jumps over the lazy dog", "hello", "the quick brown fox", "café naïve 你好"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tidal.gpu.random_model import build_model_dir

    return build_model_dir(tmp_path_factory.mktemp("cross") / "tiny", "qwen3", num_labels=1)


@pytest.fixture(scope="module")
def client(model_dir: Path) -> Iterator[TestClient]:
    engine = AsyncEngine(EngineConfig(model=str(model_dir), kv_cache_memory=4 << 20,
                                      max_num_seqs=8, max_num_batched_tokens=16,
                                      dtype="float32", runner="pooling"))
    with TestClient(build_app(engine, ServerSettings(served_model_name="tiny"))) as test_client:
        yield test_client


@torch.no_grad()
def hf_scores(model_dir: Path, pairs: list[tuple[str, str]]) -> list[float]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    return [torch.sigmoid(hf(**tokenizer(a, b, return_tensors="pt")).logits[0, 0]).item()
            for a, b in pairs]


def test_score_and_rerank_are_the_cross_encoders(client: TestClient, model_dir: Path) -> None:
    want = hf_scores(model_dir, [(QUERY, d) for d in DOCS])
    scores = client.post("/v1/score", json={"text_1": QUERY, "text_2": DOCS}).json()
    assert [d["score"] for d in scores["data"]] == pytest.approx(want, abs=1e-5)
    ranked = client.post("/v1/rerank", json={"model": "tiny", "query": QUERY,
                                             "documents": DOCS}).json()
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    assert [r["index"] for r in ranked["results"]] == order
    assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx(
        [want[i] for i in order], abs=1e-5)
    assert ranked["results"][0]["document"] == {"text": DOCS[order[0]]}
    pairwise = client.post("/v1/score", json={"text_1": DOCS[:2], "text_2": DOCS[2:]}).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(
        hf_scores(model_dir, list(zip(DOCS[:2], DOCS[2:]))), abs=1e-5)


def test_classify(client: TestClient, model_dir: Path) -> None:
    reply = client.post("/v1/classify", json={"input": DOCS[:2]}).json()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        want = [torch.sigmoid(hf(torch.tensor([tokenizer.encode(d)])).logits[0, 0]).item()
                for d in DOCS[:2]]
    assert [d["probs"][0] for d in reply["data"]] == pytest.approx(want, abs=1e-5)
    assert reply["data"][0]["label"] == "LABEL_0" and reply["data"][0]["num_classes"] == 1


@pytest.mark.parametrize("path,body,param", [
    ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/v1/rerank", {"documents": DOCS}, "query"),
    ("/v1/rerank", {"query": "", "documents": DOCS}, "query"),
    ("/v1/score", {"text_1": QUERY, "text_2": []}, "text_2"),
    ("/v1/classify", {"input": []}, "input"),
])
def test_bad_input_is_a_400_naming_the_field(client: TestClient, path: str, body: dict,
                                             param: str) -> None:
    resp = client.post(path, json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_a_cross_encoder_makes_no_embeddings(client: TestClient) -> None:
    resp = client.post("/v1/embeddings", json={"input": "hello"})
    assert resp.status_code == 400 and "classifier" in resp.json()["error"]["message"]
    from tidal.app.banner import startup_banner

    engine = client.app.state.tidal.engine  # type: ignore[attr-defined]
    banner = startup_banner(engine, ServerSettings(served_model_name="tiny"))
    assert "pooling: a sequence classifier of 1 label(s)" in banner


def test_score_needs_a_one_label_classifier() -> None:
    from types import SimpleNamespace

    from tidal.app.cross_encoder import check_single_label
    from tidal.app.errors import ApiError

    with pytest.raises(ApiError) as err:
        check_single_label(SimpleNamespace(classifier_labels=("no", "yes")))  # type: ignore
    assert err.value.status == 400 and err.value.code == "not_a_cross_encoder"
