"""What every handler needs: the engine, the tokenizer, the settings and the metrics.

One ``ServerState`` lives on ``app.state.tidal``. Handlers read the engine's static facts
(context length, vocabulary, KV-cache capacity) from here, never from scheduler state.
"""

from __future__ import annotations

import dataclasses
import functools
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tidal.app.admission import Admission
from tidal.app.body_screen import screen_pool
from tidal.app.chat_template import ChatTemplate
from tidal.app.compile_gate import CompileGate
from tidal.app.metrics import ServerMetrics
from tidal.app.refusals import RefusalMeter
from tidal.app.response_store import ResponseStore
from tidal.core.token_decoders import token_bytes

if TYPE_CHECKING:
    from tidal.core.async_engine import AsyncEngine

DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # 4 MiB of JSON body
PREPARE_WORKERS = 4  # threads preparing request bodies (the tokenizer releases the GIL)
# Seconds a request's body may take to arrive, all of it, after its headers: 4 MiB at 70 KB/s
DEFAULT_REQUEST_BODY_TIMEOUT = 60.0
DEFAULT_RESPONSE_STORE_ENTRIES = 4096
DEFAULT_RESPONSE_STORE_BYTES = 64 << 20


@dataclass
class ServerSettings:
    served_model_name: str
    model_path: str = ""
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    host: str = "127.0.0.1"
    port: int = 8000
    allowed_origins: list[str] = field(default_factory=list)  # CORS; none: same origin only
    # Host header names served (DNS rebinding); None: any. The CLI's default on a loopback bind
    # is the loopback names (app/guard.py's ``default_allowed_hosts``).
    allowed_hosts: list[str] | None = None
    metrics_without_key: bool = False  # /metrics open to a scraper without --api-key's key
    request_body_timeout: float = DEFAULT_REQUEST_BODY_TIMEOUT  # seconds for a whole body
    chat_template: str | None = None  # a template file to use instead of the tokenizer's
    tool_call_parser: str | None = None  # a name in tool_parsers.PARSERS; None: from the template
    reasoning_parser: str | None = None  # a name in reasoning.FORMATS, "none"; None: template
    request_timeout: float | None = None  # seconds a request may wait and run; None: no limit
    enable_request_tracing: bool = False  # a JSON log line per finished request
    otlp_traces_endpoint: str | None = None  # an OTLP/HTTP collector for request spans
    # Per-request caps and admission control (docs/robustness.md): each cap is a 400 naming
    # its field, each admission limit a 429 with Retry-After
    max_prompts_per_request: int = 256  # prompts of one /v1/completions request
    max_request_tokens: int = 1 << 20  # prompt tokens + n x max_tokens, over its prompts
    max_tools: int = 128  # tools of one chat request (OpenAI's limit)
    max_waiting_seqs: int = 512  # sequences waiting past a full batch before 429
    max_waiting_seqs_per_client: int | None = None  # one client's share; None: half
    fair_share_by: str = "address"  # who a client is: address, api-key, user or none
    scheduling_policy: str = "fcfs"  # the engine's: a request's priority needs "priority"
    # the Responses API's stored responses (app/response_store.py): the oldest go past either
    response_store_entries: int = DEFAULT_RESPONSE_STORE_ENTRIES
    response_store_bytes: int = DEFAULT_RESPONSE_STORE_BYTES


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Any
    settings: ServerSettings
    metrics: ServerMetrics
    chat_template: ChatTemplate
    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int  # tokens the whole KV cache holds: one sequence can use no more
    max_num_seqs: int  # sequences in one batch: how many one request may have in the engine
    # the engine's configuration as plain values, for /get_server_info
    engine_config: dict[str, Any] = field(default_factory=dict)
    embedding_size: int = 0  # the width of a pooling model's embeddings (0: unknown)
    # a sequence classifier's labels (a cross-encoder's scores, app/cross_encoder.py); ()
    # for an embedding or generating model
    classifier_labels: tuple[str, ...] = ()
    # the Responses API's stored responses, for ``previous_response_id`` and ``GET``; read on
    # the prepare threads, so made here rather than on first use
    responses: ResponseStore = field(init=False, repr=False)
    # one grammar compile at a time per client (app/compile_gate.py)
    compile_gate: CompileGate = field(default_factory=CompileGate, repr=False)
    _token_text: dict[int, str] = field(default_factory=dict, repr=False)
    _token_bytes: dict[int, bytes] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.responses = ResponseStore(self.settings.response_store_entries,
                                       self.settings.response_store_bytes)

    @property
    def served_model_name(self) -> str:
        return self.settings.served_model_name

    @classmethod
    def from_engine(cls, engine: AsyncEngine, settings: ServerSettings,
                    metrics: ServerMetrics | None = None) -> ServerState:
        core = engine.core
        stats = engine.stats
        return cls(
            engine=engine, tokenizer=engine.tokenizer, settings=settings,
            metrics=metrics or ServerMetrics(model_name=settings.served_model_name),
            chat_template=ChatTemplate.for_tokenizer(engine.tokenizer,
                                                     settings.chat_template),
            max_model_len=engine.max_model_len, vocab_size=core.vocab_size,
            kv_capacity_tokens=stats.num_total_blocks * core.config.block_size,
            max_num_seqs=core.config.max_num_seqs,
            engine_config=dataclasses.asdict(core.config),
            embedding_size=getattr(core.executor.model_config, "hidden_size", 0),
            classifier_labels=getattr(getattr(core, "pooling", None), "labels", ()))

    @functools.cached_property
    def admission(self) -> Admission:
        return Admission(self.max_num_seqs, self.settings.max_waiting_seqs,
                         self.settings.max_waiting_seqs_per_client, self.metrics)

    @functools.cached_property
    def refusals(self) -> RefusalMeter:
        return RefusalMeter()

    @functools.cached_property
    def prepare_pool(self) -> ThreadPoolExecutor:
        """Threads that parse, validate, template and tokenize request bodies, off the event
        loop: that work grows with the body (a 3.9 MB body of 800,000 prompts held every
        client for 20 s when it ran on the loop)."""
        return ThreadPoolExecutor(max_workers=PREPARE_WORKERS,
                                  thread_name_prefix="tidal-prepare")

    @functools.cached_property
    def screen_pool(self) -> Executor:
        """The worker process that parses large bodies first (``app/body_screen.py``)."""
        return screen_pool()

    @property
    def context_tokens(self) -> int:
        """The longest sequence, prompt and output together: the model's context, or the
        whole KV cache where that holds fewer tokens."""
        return min(self.max_model_len, self.kv_capacity_tokens)

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """More characters than a prompt that fits the context can have: the context times the
        vocabulary's longest token string, times 4 for normalizers that merge characters.
        Longer prompts are refused before tokenizing, which runs on the event loop (a 4 MiB
        prompt took 2.3 s there, every other client waiting)."""
        longest = max(map(len, self.tokenizer.get_vocab()), default=1)
        return 4 * self.context_tokens * longest

    def token_text(self, token_id: int) -> str:
        """The text of one token, as logprobs report it (cached: the vocabulary is fixed)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token, as logprobs report them: a byte token that is part of a
        character has its own byte, not its text's U+FFFD (cached)."""
        raw = self._token_bytes.get(token_id)
        if raw is None:
            raw = token_bytes(self.tokenizer, token_id)
            if raw is None:
                raw = self.token_text(token_id).encode()
            self._token_bytes[token_id] = raw
        return raw
