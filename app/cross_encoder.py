"""Cross-encoder scoring on a ``--runner pooling`` server whose model is a sequence classifier
(``*ForSequenceClassification``, core/pooling.py): ``/v1/score`` and ``/v1/rerank`` read each
(query, document) pair as one sequence, the tokenizer's pair encoding
(``tokenizer(query, document)``, as sentence-transformers' ``CrossEncoder`` does), and score
it with the model's one label's probability; and ``POST /v1/classify`` (vLLM's), each input's
labels' probabilities. An embedding model's scores stay cosines (app/scoring.py)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request

from tidal.app.embeddings import (
    PreparedPooling,
    admit,
    check_pooling_server,
    embed_all,
    pooling_input,
    pooling_usage,
)
from tidal.app.errors import ApiError, bad_request
from tidal.app.handling import read_request
from tidal.app.prepare import check_model
from tidal.app.schemas import ClassifyRequest, validate_body
from tidal.app.server_state import ServerState


def check_single_label(state: ServerState) -> None:
    """400 unless the classifier has the one label whose probability is a pair's score."""
    labels = len(state.classifier_labels)
    if labels != 1:
        raise ApiError(400, f"This model classifies into {labels} labels; /v1/score and "
                            "/v1/rerank need a one-label cross-encoder: use /v1/classify",
                       code="not_a_cross_encoder")


def pair_input(state: ServerState, first: str, second: str, param: str) -> list[int]:
    """The token ids of ``(first, second)`` as one sequence, checked against the context."""
    if len(first) + len(second) > state.max_prompt_chars:
        raise bad_request(f"{param}: the pair has {len(first) + len(second)} characters, more "
                          f"than this model's context of {state.context_tokens} tokens can hold",
                          param, code="context_length_exceeded")
    ids = state.tokenizer(first, second)["input_ids"]
    return pooling_input(state, list(ids), param)


def prepare_pairs(state: ServerState, model: str | None, pairs: list[tuple[str, str]],
                  param: str, prefix: str, body: Any) -> PreparedPooling:
    """``pairs`` as one pooling request of a sequence each (``param`` names them in errors)."""
    check_single_label(state)
    model = model or state.served_model_name
    check_model(model, state)
    if len(pairs) > state.settings.max_prompts_per_request:
        raise bad_request(f"{param} makes {len(pairs)} pairs, more than this server's limit "
                          f"of {state.settings.max_prompts_per_request} per request", param,
                          code="too_many_prompts")
    inputs = [pair_input(state, a, b, param) for a, b in pairs]
    return PreparedPooling(f"{prefix}-{uuid.uuid4().hex}", model, inputs, body=body)


async def pair_scores(state: ServerState, prep: PreparedPooling) -> list[float]:
    """Each of ``prep``'s pair sequences' score: its one label's probability."""
    return [probs[0] for probs in await embed_all(state, prep)]


def check_classifier(state: ServerState) -> None:
    check_pooling_server(state)
    if not state.classifier_labels:
        raise ApiError(400, "This model embeds text; /v1/classify needs a sequence "
                            "classification model (*ForSequenceClassification)",
                       code="not_a_classifier")


def prepare_classify_request(body: dict[str, Any], state: ServerState) -> PreparedPooling:
    check_classifier(state)
    req: ClassifyRequest = validate_body(ClassifyRequest, body)
    model = req.model or state.served_model_name
    check_model(model, state)
    if len(req.input) > state.settings.max_prompts_per_request:
        raise bad_request(f"input has {len(req.input)} prompts, more than this server's "
                          f"limit of {state.settings.max_prompts_per_request} per request",
                          "input", code="too_many_prompts")
    several = len(req.input) > 1
    inputs = [pooling_input(state, p, f"input[{i}]" if several else "input")
              for i, p in enumerate(req.input)]
    return PreparedPooling(f"classify-{uuid.uuid4().hex}", model, inputs, body=req)


async def classify(request: Request) -> Any:
    state, prep = await read_request(request, prepare_classify_request)
    return admit(state, prep, lambda: _classify_reply(state, prep))


async def _classify_reply(state: ServerState, prep: PreparedPooling
                          ) -> tuple[int, dict[str, Any]]:
    labels = state.classifier_labels
    data = []
    for i, probs in enumerate(await embed_all(state, prep)):
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": i, "label": labels[best], "probs": probs,
                     "num_classes": len(probs)})
    return 200, {"id": prep.request_id, "object": "list", "created": int(time.time()),
                 "model": prep.model, "data": data, "usage": pooling_usage(prep)}
