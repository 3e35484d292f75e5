"""Pooling (``--runner pooling``, vLLM's flag): a request is one prefill, with nothing
sampled and no KV kept after it, whose final hidden states are pooled into one embedding.

How to pool comes from the model's sentence-transformers files (``modules.json`` and its
``Pooling`` module's ``config.json``): the last token, the mean of the tokens or the first
(CLS) token; without them, the last token (Qwen3-Embedding's). Embeddings are L2-normalised,
as vLLM's are by default. A sequence classifier (``*ForSequenceClassification``: a
cross-encoder or LLM reranker) pools its last token through its ``score`` head instead, into
the probabilities of its labels: the sigmoid of its one logit, or the softmax of several (as
vLLM's and sentence-transformers' ``CrossEncoder`` do). This module holds what the engine and
the device share: the pooling method, read from plain JSON files, and the parameters of a
pooling request.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from tidal.core.outputs import RequestOutput
from tidal.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

POOLING_METHODS = ("last", "mean", "cls")
_POOLING_MODULE = "sentence_transformers.models.Pooling"
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
# a Pooling config's mode keys, in the order they are tried
_MODE_KEYS = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
              "pooling_mode_cls_token": "cls"}


@dataclass(frozen=True)
class PoolingConfig:
    method: str = "last"  # one of POOLING_METHODS
    normalize: bool = True
    labels: tuple[str, ...] = ()  # a sequence classifier's labels, by index; (): none

    @property
    def is_classifier(self) -> bool:
        """Whether the model scores its input (cross-encoder) rather than embedding it."""
        return bool(self.labels)

    @property
    def needs_every_position(self) -> bool:
        """Whether every prompt position's hidden state must be computed (mean and CLS): a
        prefix-cache hit would skip some, so such a model runs without prefix caching."""
        return self.method != "last"


def read_pooling_config(model: str | Path) -> PoolingConfig:
    """The pooling a model directory's sentence-transformers files ask for; last-token and
    normalised without them (a GGUF file has none). A sequence classifier's: its last token
    through its head."""
    root = Path(model)
    labels = classifier_labels(root)
    if labels:
        return PoolingConfig(method="last", normalize=False, labels=labels)
    modules_file = root / "modules.json"
    if not root.is_dir() or not modules_file.is_file():
        return PoolingConfig()
    try:
        modules = json.loads(modules_file.read_text())
        pooling = next((m for m in modules if m.get("type") == _POOLING_MODULE), None)
        method = "last"
        if pooling is not None:
            settings = json.loads((root / pooling.get("path", "") / "config.json").read_text())
            method = next((m for key, m in _MODE_KEYS.items() if settings.get(key)), "last")
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        raise ValueError(f"{modules_file}: the sentence-transformers files could not be read: "
                         f"{exc}") from None
    if not any(m.get("type") == _NORMALIZE_MODULE for m in modules):
        logger.info("%s has no Normalize module; embeddings are normalised anyway, as vLLM's "
                    "are by default", modules_file)
    return PoolingConfig(method=method, normalize=True)


def classifier_labels(root: Path) -> tuple[str, ...]:
    """The labels of the sequence classifier in directory ``root`` (``id2label``'s values by
    index, else ``LABEL_i``), or () where ``config.json`` names no such architecture."""
    try:
        raw = json.loads((root / "config.json").read_text())
        arch = (raw.get("architectures") or [""])[0]
    except (OSError, ValueError, AttributeError, TypeError, IndexError, KeyError):
        return ()  # no readable config: the model loader says why, if it must
    if not isinstance(arch, str) or not arch.endswith("ForSequenceClassification"):
        return ()
    id2label = raw.get("id2label")
    if isinstance(id2label, dict) and id2label:
        return tuple(str(id2label.get(str(i), f"LABEL_{i}")) for i in range(len(id2label)))
    count = raw.get("num_labels", 2)
    return tuple(f"LABEL_{i}" for i in range(count if isinstance(count, int) else 2))


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding, in vLLM's shape (``LLM.embed``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


def embedding_output(out: RequestOutput) -> EmbeddingRequestOutput:
    """A finished pooling request's output as vLLM's ``EmbeddingRequestOutput``."""
    if out.error or out.embedding is None:
        raise RuntimeError(f"request {out.request_id} made no embedding: "
                           f"{out.error or 'it did not finish'}")
    return EmbeddingRequestOutput(out.request_id, out.prompt_token_ids,
                                  EmbeddingOutput(out.embedding), out.finished)


def pooling_params() -> SamplingParams:
    """The parameters of a pooling request: its prompt computed, nothing generated."""
    return SamplingParams(max_tokens=0, pooling=True, detokenize=False)


def check_runner(runner: str, params: SamplingParams) -> None:
    """A pooling engine takes pooling requests only, a generating one none of them."""
    if runner == "pooling" and not params.pooling:
        raise ValueError("this engine runs --runner pooling: it makes embeddings "
                         "(/v1/embeddings, LLM.embed) and generates no text")
    if runner != "pooling" and params.pooling:
        raise ValueError("this engine runs --runner generate: embeddings need a server "
                         "started with --runner pooling")
