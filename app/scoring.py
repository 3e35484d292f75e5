"""``POST /v1/score`` and ``POST /v1/rerank`` (vLLM's shapes; rerank also Jina's and
Cohere's) on a pooling server: for an embedding model, the cosine similarity of the pooled
embeddings of each pair (vLLM's bi-encoder scoring; each distinct text embedded once); for a
sequence classifier, each pair read as one sequence by the cross-encoder
(app/cross_encoder.py)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
from starlette.requests import Request

from tidal.app.cross_encoder import pair_scores, prepare_pairs
from tidal.app.embeddings import (
    PreparedPooling,
    admit,
    check_pooling_server,
    embed_all,
    pooling_input,
    pooling_usage,
)
from tidal.app.errors import bad_request
from tidal.app.handling import read_request
from tidal.app.prepare import check_model
from tidal.app.schemas import RerankRequest, ScoreRequest, validate_body
from tidal.app.server_state import ServerState


def cosine(a: list[float], b: list[float]) -> float:
    u, v = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(u @ v / max(float(np.linalg.norm(u) * np.linalg.norm(v)), 1e-12))


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one ``text_1`` against each ``text_2``, else pairwise by index."""
    left = [text_1] if isinstance(text_1, str) else text_1
    right = [text_2] if isinstance(text_2, str) else text_2
    if not left or not right:
        raise bad_request("text_1 and text_2 must not be empty", "text_1" if not left
                          else "text_2")
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        raise bad_request(f"text_1 has {len(left)} texts and text_2 {len(right)}: give one "
                          "text_1, or as many as text_2", "text_2")
    return list(zip(left, right))


def _prepare(state: ServerState, model: str | None, texts: list[str], param: str,
             prefix: str, body: Any) -> PreparedPooling:
    """The distinct ``texts`` as one pooling request (``param`` names them in errors)."""
    check_pooling_server(state)
    model = model or state.served_model_name
    check_model(model, state)
    if len(texts) > state.settings.max_prompts_per_request:
        raise bad_request(f"{param} has {len(texts)} texts, more than this server's limit of "
                          f"{state.settings.max_prompts_per_request} per request", param,
                          code="too_many_prompts")
    inputs = [pooling_input(state, t, param) for t in texts]
    return PreparedPooling(f"{prefix}-{uuid.uuid4().hex}", model, inputs, body=body)


def prepare_score_request(body: dict[str, Any], state: ServerState) -> PreparedPooling:
    check_pooling_server(state)
    req: ScoreRequest = validate_body(ScoreRequest, body)
    pairs = score_pairs(req.text_1, req.text_2)
    if state.classifier_labels:
        return prepare_pairs(state, req.model, pairs, "text_2", "score", (req, pairs, None))
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    return _prepare(state, req.model, texts, "text_2", "score", (req, pairs, texts))


def prepare_rerank_request(body: dict[str, Any], state: ServerState) -> PreparedPooling:
    check_pooling_server(state)
    req: RerankRequest = validate_body(RerankRequest, body)
    pairs = [(req.query, doc) for doc in req.documents]
    if state.classifier_labels:
        return prepare_pairs(state, req.model, pairs, "documents", "rerank", (req, pairs, None))
    texts = list(dict.fromkeys([req.query, *req.documents]))
    return _prepare(state, req.model, texts, "documents", "rerank", (req, pairs, texts))


async def score(request: Request) -> Any:
    state, prep = await read_request(request, prepare_score_request)
    return admit(state, prep, lambda: _score_reply(state, prep))


async def rerank(request: Request) -> Any:
    state, prep = await read_request(request, prepare_rerank_request)
    return admit(state, prep, lambda: _rerank_reply(state, prep))


async def scores_of(state: ServerState, prep: PreparedPooling) -> list[float]:
    """Each of the request's pairs' score: the cross-encoder's, or without one (no
    ``texts`` in the body) the cosine of the two texts' embeddings."""
    _, pairs, texts = prep.body
    if texts is None:
        return await pair_scores(state, prep)
    by_text = dict(zip(texts, await embed_all(state, prep)))
    return [cosine(by_text[a], by_text[b]) for a, b in pairs]


async def _score_reply(state: ServerState, prep: PreparedPooling) -> tuple[int, dict[str, Any]]:
    data = [{"index": i, "object": "score", "score": value}
            for i, value in enumerate(await scores_of(state, prep))]
    return 200, {"id": prep.request_id, "object": "list", "created": int(time.time()),
                 "model": prep.model, "data": data, "usage": pooling_usage(prep)}


async def _rerank_reply(state: ServerState, prep: PreparedPooling
                        ) -> tuple[int, dict[str, Any]]:
    req = prep.body[0]
    results = [{"index": i, "relevance_score": value,
                **({"document": {"text": doc}} if req.return_documents else {})}
               for i, (doc, value) in enumerate(zip(req.documents,
                                                    await scores_of(state, prep)))]
    results.sort(key=lambda r: -r["relevance_score"])
    if req.top_n:
        results = results[:req.top_n]
    return 200, {"id": prep.request_id, "model": prep.model, "results": results,
                 "usage": pooling_usage(prep)}
