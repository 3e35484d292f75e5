"""Prompt logprobs over HTTP (``echo`` with ``logprobs``, vLLM's ``prompt_logprobs``),
``/tokenize`` and ``/detokenize``, driven in process against a tiny random Llama and held to
HF transformers' log_softmax of its logits."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from starlette.testclient import TestClient
from transformers import AutoModelForCausalLM, AutoTokenizer

from tidal.app.routes import build_app
from tidal.app.server_state import ServerSettings
from tidal.core.async_engine import AsyncEngine
from tidal.core.config import EngineConfig

SSE_EVENT = re.compile(rb"data: (\{.*?\}|\[DONE\])\n\n", re.S)
PROMPT = "the quick brown fox jumps over the lazy dog"
CHAT = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tidal.gpu.random_model import build_model_dir

    return build_model_dir(tmp_path_factory.mktemp("plp_api") / "tiny", "llama")


@pytest.fixture(scope="module")
def client(model_dir: Path) -> Iterator[TestClient]:
    """Prefill in chunks of 8 tokens, so a prompt's scores span several steps."""
    engine = AsyncEngine(EngineConfig(model=str(model_dir), kv_cache_memory=4 << 20,
                                      max_num_seqs=8, max_num_batched_tokens=8,
                                      dtype="float32"))
    with TestClient(build_app(engine, ServerSettings(served_model_name="tiny",
                                                     api_key="sesame")),
                    headers={"Authorization": "Bearer sesame"}) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Any:
    """The prompt's ids and HF's [len - 1, vocab] logprobs: row j scores token j + 1."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tokenizer.encode(PROMPT)
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    return ids, torch.log_softmax(logits, dim=-1)


def _check_echo(logprobs: dict[str, Any], reference: Any, top: int) -> None:
    ids, ref = reference
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for j in range(1, len(ids)):
        assert logprobs["token_logprobs"][j] == pytest.approx(ref[j - 1, ids[j]].item(),
                                                              abs=1e-4)
        best = sorted(logprobs["top_logprobs"][j].values(), reverse=True)
        assert best[0] == pytest.approx(ref[j - 1].max().item(), abs=1e-4)
        assert len(best) <= top + 1  # tokens of one text share an entry


def _events(client: TestClient, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200
        raw = b"".join(resp.iter_bytes())
    events = SSE_EVENT.findall(raw)
    assert events[-1] == b"[DONE]"
    return [orjson.loads(e) for e in events[:-1]]


def test_echo_with_logprobs_scores_the_prompt(client: TestClient, reference: Any) -> None:
    ids, _ = reference
    body = {"model": "tiny", "prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 3,
            "temperature": 0}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["text"].startswith(PROMPT)
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 3
    _check_echo(logprobs, reference, 2)
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"][len(ids)] == len(PROMPT)
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])

    streamed = _events(client, "/v1/completions", {**body, "stream": True})
    first = streamed[0]["choices"][0]
    assert first["text"] == PROMPT
    assert first["logprobs"]["token_logprobs"] == logprobs["token_logprobs"][:len(ids)]
    assert first["logprobs"]["text_offset"] == logprobs["text_offset"][:len(ids)]
    rest = [e["choices"][0]["logprobs"] for e in streamed[1:] if e["choices"]]
    assert [o for r in rest for o in r["text_offset"]] == logprobs["text_offset"][len(ids):]
    assert "".join(e["choices"][0]["text"] for e in streamed) == choice["text"]


def test_max_tokens_zero_with_echo_returns_the_scored_prompt(client: TestClient,
                                                             reference: Any) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0}
    reply = client.post("/v1/completions", json=body).json()
    choice = reply["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 0
    _check_echo(choice["logprobs"], reference, 1)
    plain = client.post("/v1/completions", json={**body, "logprobs": None}).json()
    assert plain["choices"][0]["text"] == PROMPT and plain["choices"][0]["logprobs"] is None
    streamed = _events(client, "/v1/completions", {**body, "stream": True})
    _check_echo(streamed[0]["choices"][0]["logprobs"], reference, 1)
    assert streamed[-1]["choices"][0]["finish_reason"] == "length"


def test_vllm_prompt_logprobs_on_completions_and_chat(client: TestClient,
                                                      reference: Any) -> None:
    ids, ref = reference
    body = {"model": "tiny", "prompt": PROMPT, "prompt_logprobs": 2, "max_tokens": 1}
    scores = client.post("/v1/completions", json=body).json()["choices"][0]["prompt_logprobs"]
    assert len(scores) == len(ids) and scores[0] is None
    for j in range(1, len(ids)):
        own = scores[j][str(ids[j])]
        assert own["logprob"] == pytest.approx(ref[j - 1, ids[j]].item(), abs=1e-4)
        assert own["rank"] >= 1 and own["decoded_token"] is not None
        top = torch.topk(ref[j - 1], 2)
        for ref_id, ref_value in zip(top.indices.tolist(), top.values.tolist()):
            assert scores[j][str(ref_id)]["logprob"] == pytest.approx(ref_value, abs=1e-4)
        assert len(scores[j]) <= 3

    chat = {"model": "tiny", "messages": CHAT, "prompt_logprobs": 0, "max_tokens": 1}
    reply = client.post("/v1/chat/completions", json=chat).json()
    assert len(reply["prompt_logprobs"]) == reply["usage"]["prompt_tokens"]
    assert reply["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in reply["prompt_logprobs"][1:])


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 1, "stream": True},
     "prompt_logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": 1, "max_tokens": 0},
     "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/tokenize", {"messages": [{"role": "nobody", "content": "x"}]}, "messages[0].role"),
    ("/tokenize", {"prompt": "a", "return_token_strs": "yes"}, "return_token_strs"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": [1, "a"]}, "tokens[1]"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
])
def test_bad_requests_name_the_field(client: TestClient, path: str, body: dict,
                                     param: str) -> None:
    if path.startswith("/v1"):
        body = {"model": "tiny", **body}
    resp = client.post(path, json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_tokenize_and_detokenize(client: TestClient, model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    answer = client.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True})
    assert answer.status_code == 200
    got = answer.json()
    assert got["tokens"] == tokenizer.encode(PROMPT) and got["count"] == len(got["tokens"])
    assert got["token_strs"] == tokenizer.convert_ids_to_tokens(got["tokens"])
    models = client.get("/v1/models").json()["data"][0]
    assert got["max_model_len"] == models["max_model_len"] > 0
    bare = client.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False})
    assert bare.json()["tokens"] == tokenizer.encode(PROMPT, add_special_tokens=False)
    assert "token_strs" not in bare.json()

    back = client.post("/detokenize", json={"tokens": bare.json()["tokens"]}).json()
    assert back == {"prompt": tokenizer.decode(bare.json()["tokens"])}
    assert back["prompt"].strip() == PROMPT

    chat = client.post("/tokenize", json={"model": "tiny", "messages": CHAT}).json()
    used = client.post("/v1/chat/completions", json={"model": "tiny", "messages": CHAT,
                                                     "max_tokens": 1}).json()
    assert chat["count"] == used["usage"]["prompt_tokens"]
    no_prompt = client.post("/tokenize", json={"messages": CHAT,
                                               "add_generation_prompt": False}).json()
    assert no_prompt["count"] < chat["count"]
    assert no_prompt["tokens"] == chat["tokens"][:no_prompt["count"]]


def test_tokenize_needs_the_api_key_and_the_served_model(client: TestClient) -> None:
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [5]})):
        assert client.post(path, json=body, headers={"Authorization": ""}).status_code == 401
        wrong = client.post(path, json={**body, "model": "other"})
        assert wrong.status_code == 404 and wrong.json()["error"]["param"] == "model"


def test_openai_client_echo_with_max_tokens_zero(client: TestClient) -> None:
    from openai import OpenAI

    api = OpenAI(base_url="http://testserver/v1", api_key="sesame", http_client=client)
    completion = api.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=1,
                                        max_tokens=0)
    choice = completion.choices[0]
    assert choice.text == PROMPT and choice.logprobs is not None
    assert choice.logprobs.token_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in choice.logprobs.token_logprobs[1:])
