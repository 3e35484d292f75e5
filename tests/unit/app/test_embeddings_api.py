"""``/v1/embeddings``, ``/v1/score`` and ``/v1/rerank`` on a ``--runner pooling`` server,
driven in process against a tiny random Qwen3: embeddings held to HF transformers'
``AutoModel`` last hidden state (last token, normalised), the API's shapes and errors, and
the official ``openai`` client."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from starlette.testclient import TestClient
from transformers import AutoModel, AutoTokenizer

from tidal.app.routes import build_app
from tidal.app.server_state import ServerSettings
from tidal.core.async_engine import AsyncEngine
from tidal.core.config import EngineConfig

TEXTS = ["the quick brown fox", "jumps over the lazy dog again and again", "hello"]
HIDDEN = 64  # the random model's hidden size: its embeddings' width


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tidal.gpu.random_model import build_model_dir

    return build_model_dir(tmp_path_factory.mktemp("embed_api") / "tiny", "qwen3")


def _client(model_dir: Path, runner: str) -> TestClient:
    engine = AsyncEngine(EngineConfig(model=str(model_dir), kv_cache_memory=4 << 20,
                                      max_num_seqs=8, max_num_batched_tokens=8,
                                      dtype="float32", runner=runner))
    return TestClient(build_app(engine, ServerSettings(served_model_name="tiny")))


@pytest.fixture(scope="module")
def client(model_dir: Path) -> Iterator[TestClient]:
    with _client(model_dir, "pooling") as test_client:
        yield test_client


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[str, np.ndarray]:
    """HF's normalised last-token hidden state of each text."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        for text in TEXTS:
            hidden = hf(torch.tensor([tokenizer.encode(text)])).last_hidden_state[0, -1]
            out[text] = torch.nn.functional.normalize(hidden, dim=-1).numpy()
    return out


def _embed(client: TestClient, **body: object) -> dict:
    resp = client.post("/v1/embeddings", json={"model": "tiny", **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_float_and_base64_embeddings_match_hf(client: TestClient, model_dir: Path,
                                              reference: dict[str, np.ndarray]) -> None:
    floats = _embed(client, input=TEXTS)
    assert floats["object"] == "list" and floats["model"] == "tiny"
    assert [d["index"] for d in floats["data"]] == [0, 1, 2]
    for text, item in zip(TEXTS, floats["data"]):
        assert item["object"] == "embedding"
        np.testing.assert_allclose(item["embedding"], reference[text], atol=1e-4)
    tokens = sum(len(AutoTokenizer.from_pretrained(model_dir).encode(t)) for t in TEXTS)
    assert floats["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    packed = _embed(client, input=TEXTS, encoding_format="base64")
    for item, float_item in zip(packed["data"], floats["data"]):
        decoded = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
        assert decoded.shape == (HIDDEN,)  # another batch: the same to float32 rounding
        np.testing.assert_allclose(decoded, float_item["embedding"], atol=1e-6)


def test_token_id_inputs_and_dimensions(client: TestClient, model_dir: Path,
                                        reference: dict[str, np.ndarray]) -> None:
    ids = [AutoTokenizer.from_pretrained(model_dir).encode(t) for t in TEXTS[:2]]
    one = _embed(client, input=ids[0])["data"]
    several = _embed(client, input=ids)["data"]
    assert len(one) == 1 and len(several) == 2
    np.testing.assert_allclose(one[0]["embedding"], reference[TEXTS[0]], atol=1e-4)
    np.testing.assert_allclose(several[1]["embedding"], reference[TEXTS[1]], atol=1e-4)
    cut = np.asarray(_embed(client, input=TEXTS[0], dimensions=16)["data"][0]["embedding"])
    want = reference[TEXTS[0]][:16] / np.linalg.norm(reference[TEXTS[0]][:16])
    assert cut.shape == (16,)
    np.testing.assert_allclose(cut, want, atol=1e-4)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "dimensions": HIDDEN + 1}, "dimensions"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": []}, "input"),
    ({"input": [1, "a"]}, "input"),
    ({"input": [[5, 10 ** 9]]}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "model": "other"}, "model"),
])
def test_errors_name_the_field(client: TestClient, body: dict, param: str) -> None:
    resp = client.post("/v1/embeddings", json={"model": "tiny", **body})
    assert resp.status_code in (400, 404), resp.text
    assert resp.json()["error"]["param"] == param


def test_score_and_rerank_rank_by_cosine(client: TestClient,
                                         reference: dict[str, np.ndarray]) -> None:
    query, docs = TEXTS[0], [TEXTS[2], TEXTS[0], TEXTS[1]]  # the query itself is among them
    want = [float(reference[query] @ reference[d]) for d in docs]
    scores = client.post("/v1/score", json={"model": "tiny", "text_1": query,
                                            "text_2": docs}).json()
    assert [d["index"] for d in scores["data"]] == [0, 1, 2]
    np.testing.assert_allclose([d["score"] for d in scores["data"]], want, atol=1e-4)
    assert scores["data"][1]["score"] == pytest.approx(1.0, abs=1e-5)
    pairwise = client.post("/v1/score", json={"text_1": docs, "text_2": docs[::-1]}).json()
    assert pairwise["data"][1]["score"] == pytest.approx(1.0, abs=1e-5)
    ranked = client.post("/v1/rerank", json={"model": "tiny", "query": query,
                                             "documents": docs, "top_n": 2}).json()
    order = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in ranked["results"]] == order == [1, order[1]]
    assert ranked["results"][0]["document"] == {"text": query}
    bare = client.post("/v2/rerank", json={"query": query, "documents": docs,
                                           "return_documents": False}).json()
    assert len(bare["results"]) == 3 and "document" not in bare["results"][0]
    bad = client.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["a", "b", "c"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_2"


def test_openai_client_embeddings_create(client: TestClient,
                                         reference: dict[str, np.ndarray]) -> None:
    from openai import OpenAI

    api = OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)
    reply = api.embeddings.create(model="tiny", input=TEXTS[:2])  # base64 under the hood
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > 0
    for text, item in zip(TEXTS, reply.data):
        np.testing.assert_allclose(item.embedding, reference[text], atol=1e-4)
    short = api.embeddings.create(model="tiny", input=TEXTS[2], dimensions=8,
                                  encoding_format="float")
    assert len(short.data[0].embedding) == 8


def test_the_banner_says_how_the_server_pools(client: TestClient) -> None:
    from tidal.app.banner import startup_banner

    engine = client.app.state.tidal.engine  # type: ignore[attr-defined]
    banner = startup_banner(engine, ServerSettings(served_model_name="tiny"))
    assert "runner    pooling: last-token pooling, normalised embeddings of 64" in banner
    assert "prefix caching on" in banner


def test_each_runner_refuses_the_other_runners_routes(client: TestClient,
                                                      model_dir: Path) -> None:
    chat = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi",
                                                 "max_tokens": 2})
    assert chat.status_code == 400 and "--runner pooling" in chat.json()["error"]["message"]
    classify = client.post("/v1/classify", json={"input": "hi"})  # an embedding model
    assert classify.status_code == 400 and classify.json()["error"]["code"] == "not_a_classifier"
    with _client(model_dir, "generate") as generating:
        for path, body in (("/v1/embeddings", {"input": "hi"}),
                           ("/v1/classify", {"input": "hi"}),
                           ("/v1/rerank", {"query": "a", "documents": ["b"]})):
            resp = generating.post(path, json=body)
            assert resp.status_code == 400
            assert "--runner generate" in resp.json()["error"]["message"]


def test_cli_runner_flag() -> None:
    from tidal.app.cli import build_parser

    assert build_parser().parse_args(["serve"]).runner == "generate"
    assert build_parser().parse_args(["serve", "--runner", "pooling"]).runner == "pooling"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--runner", "embed"])
