"""``POST /v1/embeddings`` in OpenAI's shape, on a server started with ``--runner pooling``
(core/pooling.py): each input one prefill whose pooled, normalised hidden state comes back
as floats or base64 (little-endian float32), cut to ``dimensions`` and normalised again
(Matryoshka) when asked. ``embed_all`` is what ``/v1/score`` and ``/v1/rerank`` share."""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from starlette.requests import Request

from tidal.app.admission import Admitted
from tidal.app.body_screen import check_prompt_count
from tidal.app.conversation import encode_prompt
from tidal.app.errors import ApiError, bad_request
from tidal.app.handling import generate, merge_streams, read_request, timed_out, timeout_error
from tidal.app.prepare import check_client_token_ids, check_model
from tidal.app.schemas import EmbeddingRequest, validate_body
from tidal.app.server_state import ServerState
from tidal.app.sse import DeferredJSONResponse
from tidal.core.lifecycle import Arrival
from tidal.core.pooling import pooling_params
from tidal.core.sampling_params import SamplingParams


@dataclass
class PreparedPooling:
    """A pooling request's prompts as token ids; the fields ``read_request`` stamps."""

    request_id: str
    model: str
    inputs: list[list[int]]
    params: SamplingParams = field(default_factory=pooling_params)
    timeout: float | None = None
    priority: int = 0
    arrival: Arrival | None = None
    body: Any = None  # the validated request


def check_pooling_server(state: ServerState) -> None:
    """400 on a server that generates text (``--runner generate``)."""
    runner = state.engine_config.get("runner", "generate")
    if runner != "pooling":
        raise ApiError(400, f"This server runs --runner {runner}: embeddings, scores and "
                            "reranking need a server started with --runner pooling",
                       code="wrong_runner")


def pooling_input(state: ServerState, prompt: str | list[int], param: str) -> list[int]:
    """One input's token ids, checked against the vocabulary and the context."""
    if isinstance(prompt, str):
        ids = encode_prompt(state, prompt, param)
    else:
        check_client_token_ids(state, prompt, param)
        ids = list(prompt)
    limit = min(state.context_tokens - 1, state.kv_capacity_tokens)
    if not ids:
        raise bad_request(f"{param} is empty once tokenized", param)
    if len(ids) > limit:
        raise bad_request(f"{param} has {len(ids)} tokens; this model embeds at most {limit}",
                          param, code="context_length_exceeded")
    return ids


def prepare_embedding_request(body: dict[str, Any], state: ServerState) -> PreparedPooling:
    check_pooling_server(state)
    check_prompt_count(body.get("input"), state.settings.max_prompts_per_request)
    if state.classifier_labels:
        raise ApiError(400, "This model is a sequence classifier: it scores (/v1/score, "
                            "/v1/rerank, /v1/classify) and makes no embeddings",
                       code="not_an_embedding_model")
    req: EmbeddingRequest = validate_body(EmbeddingRequest, body)
    model = req.model or state.served_model_name
    check_model(model, state)
    if req.dimensions is not None and state.embedding_size and \
            req.dimensions > state.embedding_size:
        raise bad_request(f"dimensions is {req.dimensions}, more than this model's "
                          f"{state.embedding_size}", "dimensions")
    several = len(req.input) > 1
    inputs = [pooling_input(state, p, f"input[{i}]" if several else "input")
              for i, p in enumerate(req.input)]
    return PreparedPooling(f"embd-{uuid.uuid4().hex}", model, inputs, body=req)


async def embeddings(request: Request) -> Any:
    state, prep = await read_request(request, prepare_embedding_request)
    return admit(state, prep, lambda: _reply(state, prep))


def admit(state: ServerState, prep: PreparedPooling,
          reply: Callable[[], Awaitable[tuple[int, Any]]]) -> Admitted:
    """The reply, computed once the response starts (an ``ApiError`` its JSON), holding the
    request's sequences until it is sent."""
    assert prep.arrival is not None
    ticket = state.admission.admit(prep.arrival.client,
                                   min(len(prep.inputs), state.max_num_seqs))

    async def compute() -> tuple[int, Any]:
        try:
            return await reply()
        except ApiError as err:
            return err.status, err.to_dict()

    return Admitted(DeferredJSONResponse(compute), ticket)


async def embed_all(state: ServerState, prep: PreparedPooling) -> list[list[float]]:
    """The embeddings of ``prep.inputs``, in order, a batch's worth in the engine at once."""
    streams = [generate(state, f"{prep.request_id}-{i}", ids, prep.params, None, prep.arrival)
               for i, ids in enumerate(prep.inputs)]
    vectors: list[list[float] | None] = [None] * len(streams)
    async for index, out in merge_streams(streams, state.max_num_seqs):
        if timed_out(out):
            raise timeout_error(prep.arrival.timeout if prep.arrival else None)
        if out.finished:
            vectors[index] = out.embedding
    if any(v is None for v in vectors):
        raise ApiError(500, "The request failed: an input made no embedding")
    return vectors  # type: ignore[return-value]


def pooling_usage(prep: PreparedPooling) -> dict[str, int]:
    tokens = sum(len(ids) for ids in prep.inputs)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def encode_embedding(vector: list[float], dimensions: int | None, encoding: str
                     ) -> list[float] | str:
    """An embedding as sent: cut to ``dimensions`` and normalised again, then floats or
    base64 of little-endian float32 (OpenAI's)."""
    values = np.asarray(vector, dtype=np.float32)
    if dimensions is not None and dimensions < len(values):
        values = values[:dimensions]
        values = values / max(float(np.linalg.norm(values)), 1e-12)
    if encoding == "base64":
        return base64.b64encode(values.astype("<f4").tobytes()).decode("ascii")
    return values.tolist()


async def _reply(state: ServerState, prep: PreparedPooling) -> tuple[int, dict[str, Any]]:
    req: EmbeddingRequest = prep.body
    vectors = await embed_all(state, prep)
    data = [{"object": "embedding", "index": i,
             "embedding": encode_embedding(v, req.dimensions, req.encoding_format)}
            for i, v in enumerate(vectors)]
    return 200, {"id": prep.request_id, "object": "list", "created": int(time.time()),
                 "model": prep.model, "data": data, "usage": pooling_usage(prep)}
