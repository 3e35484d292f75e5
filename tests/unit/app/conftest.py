"""Fixtures of the app's unit tests."""

from __future__ import annotations

from typing import Any

import pytest

from tidal.app.chat_template import ChatTemplate
from tidal.app.metrics import ServerMetrics
from tidal.app.server_state import ServerSettings, ServerState
from tidal.core.config import DEFAULT_MODEL
from tidal.templates import TEMPLATES_DIR


class _NoEngine:
    is_alive = True


@pytest.fixture(scope="session")
def embedded_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEFAULT_MODEL)


@pytest.fixture
def hermes_state(embedded_tokenizer: Any) -> ServerState:
    """A server's state without an engine: the embedded model's tokenizer, a Hermes tool
    template, the ``qwen3`` reasoning parser and room for 8 stored responses."""
    settings = ServerSettings(served_model_name="m", reasoning_parser="qwen3",
                              response_store_entries=8)
    template = ChatTemplate.for_tokenizer(embedded_tokenizer,
                                          str(TEMPLATES_DIR / "hermes_tools.jinja"))
    return ServerState(engine=_NoEngine(), tokenizer=embedded_tokenizer,  # type: ignore[arg-type]
                       settings=settings, metrics=ServerMetrics(), chat_template=template,
                       max_model_len=4096, vocab_size=len(embedded_tokenizer),
                       kv_capacity_tokens=8192, max_num_seqs=8)
