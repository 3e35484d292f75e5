"""Unit tests of the HTTP layer: SSE framing, request validation, the engine dying under the
app, and the CLI's parsing. The engine's side of streaming is in ``test_async_engine.py``."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import orjson
import pytest
from starlette.testclient import TestClient

from tests.paths import ROOT
from tidal.app.banner import base_url, package_version
from tidal.app.chat_template import ChatTemplate
from tidal.app.cli import build_parser, parse_bytes
from tidal.app.errors import ApiError
from tidal.app.handling import chat_logprobs, completion_logprobs
from tidal.app.metrics import ServerMetrics
from tidal.app.prepare import prepare_chat_request, prepare_completion_request
from tidal.app.routes import build_app
from tidal.app.server_state import ServerSettings, ServerState
from tidal.app.sse import DONE, EventStreamResponse, race_disconnect, sse_event
from tidal.core.async_engine import AsyncEngine
from tidal.core.config import EngineConfig

SSE_EVENT = re.compile(rb"data: (\{.*?\}|\[DONE\])\n\n", re.S)
CHAT = [{"role": "user", "content": "Tell me a joke"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tidal.gpu.random_model import build_model_dir

    return build_model_dir(tmp_path_factory.mktemp("api_unit") / "tiny", "llama")


def _engine_config(model_dir: Path) -> EngineConfig:
    return EngineConfig(model=str(model_dir), kv_cache_memory=4 << 20, max_num_seqs=16)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


class _NoEngine:
    is_alive = True


@pytest.fixture
def state(tokenizer: Any) -> ServerState:
    return ServerState(engine=_NoEngine(), tokenizer=tokenizer,  # type: ignore[arg-type]
                       settings=ServerSettings(served_model_name="tiny"),
                       metrics=ServerMetrics(), chat_template=ChatTemplate.for_tokenizer(tokenizer),
                       max_model_len=64, vocab_size=len(tokenizer), kv_capacity_tokens=48,
                       max_num_seqs=8)


# -- SSE framing ------------------------------------------------------------------------------
def test_sse_event_is_byte_exact() -> None:
    payload = {"id": "x", "choices": [{"delta": {"content": "é 😀\n"}}]}
    assert sse_event(payload) == b"data: " + orjson.dumps(payload) + b"\n\n"
    assert b"\n" not in sse_event(payload)[:-2]  # newlines inside text stay escaped
    assert DONE == b"data: [DONE]\n\n"


class _Asgi:
    """A fake ASGI connection: records what is sent; disconnects on demand."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.gone = asyncio.Event()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent)


async def test_event_stream_response_frames_and_ends() -> None:
    async def events():
        yield sse_event({"n": 1})
        yield sse_event({"n": 2})
        yield DONE

    conn = _Asgi()
    await EventStreamResponse(events())({"type": "http"}, conn.receive, conn.send)
    start = conn.sent[0]
    assert start["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in start["headers"]
    assert conn.body == b'data: {"n":1}\n\ndata: {"n":2}\n\ndata: [DONE]\n\n'
    assert conn.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


async def test_disconnect_cancels_the_stream_and_runs_its_cleanup() -> None:
    cleaned = asyncio.Event()
    forever = asyncio.Event()

    async def events():
        try:
            yield sse_event({"n": 1})
            await forever.wait()
            yield sse_event({"n": 2})
        finally:
            cleaned.set()

    conn = _Asgi()
    task = asyncio.ensure_future(EventStreamResponse(events())({"type": "http"}, conn.receive,
                                                               conn.send))
    while len(conn.sent) < 2:
        await asyncio.sleep(0)
    conn.gone.set()
    await task
    assert cleaned.is_set() and conn.body == b'data: {"n":1}\n\n'


async def test_race_disconnect_returns_the_result_when_work_wins() -> None:
    conn = _Asgi()

    async def work() -> int:
        return 42

    assert await race_disconnect(conn.receive, work()) == (True, 42)


# -- validation -------------------------------------------------------------------------------
@pytest.mark.parametrize("body,param", [
    ({"messages": CHAT}, "model"),
    ({"model": "tiny"}, "messages"),
    ({"model": "tiny", "messages": []}, "messages"),
    ({"model": "tiny", "messages": "hi"}, "messages"),
    ({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"model": "tiny", "messages": [{"content": "x"}]}, "messages[0].role"),
    ({"model": "tiny", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": "tiny", "messages": [{"role": "user"}]}, "messages[0].content"),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
    ({"model": "tiny", "messages": CHAT, "temperature": "hot"}, "temperature"),
    ({"model": "tiny", "messages": CHAT, "temperature": -1}, "temperature"),
    ({"model": "tiny", "messages": CHAT, "top_p": 1.5}, "top_p"),
    ({"model": "tiny", "messages": CHAT, "top_k": -2}, "top_k"),
    ({"model": "tiny", "messages": CHAT, "n": 0}, "n"),
    ({"model": "tiny", "messages": CHAT, "n": "2"}, "n"),
    ({"model": "tiny", "messages": CHAT, "max_tokens": 0}, "max_tokens"),
    ({"model": "tiny", "messages": CHAT, "max_tokens": 1.5}, "max_tokens"),
    ({"model": "tiny", "messages": CHAT, "max_tokens": 60}, "max_tokens"),
    ({"model": "tiny", "messages": CHAT, "max_completion_tokens": 60}, "max_completion_tokens"),
    ({"model": "tiny", "messages": CHAT, "stop": 3}, "stop"),
    ({"model": "tiny", "messages": CHAT, "stop": [""]}, "stop"),
    ({"model": "tiny", "messages": CHAT, "stream": "yes"}, "stream"),
    ({"model": "tiny", "messages": CHAT, "stream_options": {"include_usage": True}},
     "stream_options"),
    ({"model": "tiny", "messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"model": "tiny", "messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({"model": "tiny", "messages": CHAT, "logit_bias": {"x": 1}}, "logit_bias"),
    ({"model": "tiny", "messages": CHAT, "logit_bias": {"999999": 1}}, "logit_bias"),
    ({"model": "tiny", "messages": CHAT, "presence_penalty": 3}, "presence_penalty"),
    ({"model": "tiny", "messages": CHAT, "min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    # no max_tokens: more than the room the context leaves
    ({"model": "tiny", "messages": CHAT, "min_tokens": 250}, "min_tokens"),
    ({"model": "tiny", "messages": CHAT, "stop": ["x"] * 33}, "stop"),
    ({"model": "tiny", "messages": CHAT, "stop": "x" * 1025}, "stop"),
    # subnormals: read as 0 here as on the engine thread, which flushes them
    ({"model": "tiny", "messages": CHAT, "top_p": 1e-310}, "top_p"),
    ({"model": "tiny", "messages": CHAT, "repetition_penalty": 1e-310}, "repetition_penalty"),
    ({"model": "tiny", "messages": CHAT, "seed": 2**64}, "seed"),
    ({"model": "tiny", "messages": CHAT, "stop_token_ids": [999999]}, "stop_token_ids"),
    ({"model": "tiny", "messages": CHAT, "skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "fox " * 80}]}, "messages"),
])
def test_bad_chat_requests_name_the_field(state: ServerState, body: dict, param: str) -> None:
    with pytest.raises(ApiError) as info:
        prepare_chat_request(body, state)
    assert info.value.status == 400, info.value.message
    assert info.value.param == param, info.value.message
    error = info.value.to_dict()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_completion_top_logprobs_always_hold_the_sampled_token(state: ServerState) -> None:
    """Logprobs are the model's raw ones: a sampled token (here by temperature, penalties or
    logit_bias) may be outside the top ``k``, and is then added as entry ``k`` + 1."""
    entry = {65: -0.1, 66: -2.5, 67: -6.0}
    block = completion_logprobs(state, [67, 65], [entry, entry], top=1, text_offset=0)
    text = state.token_text
    assert block["token_logprobs"] == [-6.0, -0.1]
    assert block["top_logprobs"] == [{text(65): -0.1, text(67): -6.0}, {text(65): -0.1}]


def test_logprobs_give_each_byte_token_its_own_byte_and_offsets_index_the_text(
        state: ServerState) -> None:
    """"é" as its two byte tokens, then "x": each byte token decodes to U+FFFD on its own, but
    its ``bytes`` are its byte, and ``text_offset`` counts the character once."""
    tokenizer = state.tokenizer
    pieces = ["Ã", "©", "x"]  # the byte-level alphabet's spelling of 0xC3, 0xA9 and "x"
    ids = tokenizer.convert_tokens_to_ids(pieces)
    assert tokenizer.decode(ids) == "éx" and tokenizer.decode(ids[:1]) == "\ufffd"
    assert [state.token_bytes(t) for t in ids] == [b"\xc3", b"\xa9", b"x"]
    block = completion_logprobs(state, ids, [{t: -1.0} for t in ids], top=1, text_offset=5)
    assert block["text_offset"] == [5, 6, 6]
    content = chat_logprobs(state, ids, [{t: -1.0} for t in ids], top=0)["content"]
    assert b"".join(bytes(e["bytes"]) for e in content).decode() == "éx"


def test_overlong_prompt_is_refused_without_tokenizing(state: ServerState,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    text = "fox " * (state.max_prompt_chars // 4 + 1)
    monkeypatch.setattr(state.tokenizer, "encode", lambda *a, **k: pytest.fail("tokenized"))
    for prepare, body, param in [
            (prepare_completion_request, {"model": "tiny", "prompt": [text, "hi"]}, "prompt[0]"),
            (prepare_chat_request, {"model": "tiny", "messages": [
                {"role": "user", "content": text}]}, "messages")]:
        with pytest.raises(ApiError) as info:
            prepare(body, state)
        assert (info.value.status, info.value.param, info.value.code) == (
            400, param, "context_length_exceeded"), info.value.message


def test_unknown_model_is_404(state: ServerState) -> None:
    with pytest.raises(ApiError) as info:
        prepare_chat_request({"model": "gpt-9", "messages": CHAT}, state)
    assert (info.value.status, info.value.param, info.value.code) == (404, "model",
                                                                      "model_not_found")


def test_chat_request_is_templated_and_tokenized(state: ServerState, tokenizer: Any) -> None:
    parts = [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "a joke"}]
    prep = prepare_chat_request({"model": "tiny", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}],
        "temperature": 0, "stop": "x", "seed": 3, "unknown_field": 1, "user": "u1",
        "stream": True, "stream_options": {"include_usage": True}}, state)
    assert prep.prompt == tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": "Tell me\na joke"}], tokenize=False,
        add_generation_prompt=True)
    assert prep.prompt_token_ids == tokenizer.encode(prep.prompt, add_special_tokens=False)
    assert prep.params.stop == ["x"] and prep.params.greedy and prep.params.seed == 3
    # no max_tokens: whatever room the context (64) and the KV cache (48 tokens) leave
    assert prep.params.max_tokens == 48 - len(prep.prompt_token_ids)
    assert prep.stream and prep.stream_options.include_usage
    assert prep.request_id.startswith("chatcmpl-")


def test_vllm_output_flags_reach_the_sampling_params(state: ServerState) -> None:
    prep = prepare_completion_request({"model": "tiny", "prompt": "hi", "stop": "x",
                                       "include_stop_str_in_output": True,
                                       "skip_special_tokens": False}, state)
    assert prep.params.include_stop_str_in_output and not prep.params.skip_special_tokens
    plain = prepare_completion_request({"model": "tiny", "prompt": "hi"}, state)
    assert not plain.params.include_stop_str_in_output and plain.params.skip_special_tokens


def test_model_may_be_left_out_when_not_required(state: ServerState) -> None:
    prep = prepare_chat_request({"messages": CHAT}, state, require_model=False)
    assert prep.model == "tiny"


@pytest.mark.parametrize("prompt,count", [("hello", 1), (["a", "b"], 2), ([5, 6, 7], 1),
                                          ([[5, 6], [7]], 2)])
def test_completion_prompt_shapes(state: ServerState, prompt: Any, count: int) -> None:
    prep = prepare_completion_request({"model": "tiny", "prompt": prompt, "n": 2}, state)
    assert len(prep.prompts) == count and prep.params.n == 2
    assert all(p.token_ids for p in prep.prompts)
    assert prep.params.max_tokens is None  # each prompt's room, decided by the engine


def test_an_unset_max_tokens_is_the_room_left_in_chat_and_completions(state: ServerState
                                                                       ) -> None:
    """The one rule (``reply_budget``): a chat's budget is the context less its prompt; a
    completion's prompts each get theirs from the engine, and the request's token budget
    counts the same room."""
    chat = prepare_chat_request({"model": "tiny", "messages": CHAT}, state)
    assert chat.params.max_tokens == state.context_tokens - len(chat.prompt_token_ids)
    room = state.context_tokens - 3
    state.settings.max_request_tokens = 3 + room
    prepare_completion_request({"model": "tiny", "prompt": [5, 6, 7]}, state)
    state.settings.max_request_tokens -= 1
    with pytest.raises(ApiError, match=f"max_tokens {room}\\)"):
        prepare_completion_request({"model": "tiny", "prompt": [5, 6, 7]}, state)


@pytest.mark.parametrize("body,param", [
    ({"model": "tiny"}, "prompt"),
    ({"model": "tiny", "prompt": []}, "prompt"),
    ({"model": "tiny", "prompt": [1, "a"]}, "prompt"),
    ({"model": "tiny", "prompt": [[1], []]}, "prompt"),
    ({"model": "tiny", "prompt": [10**9]}, "prompt"),
    ({"model": "tiny", "prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"model": "tiny", "prompt": "hi", "echo": 1}, "echo"),
    ({"model": "tiny", "prompt": ["hi", "fox " * 80]}, "prompt[1]"),
])
def test_bad_completion_requests_name_the_field(state: ServerState, body: dict,
                                                param: str) -> None:
    with pytest.raises(ApiError) as info:
        prepare_completion_request(body, state)
    assert (info.value.status, info.value.param) == (400, param), info.value.message


def test_fallback_chat_template_renders_chatml() -> None:
    class Bare:
        chat_template = None
        bos_token = eos_token = unk_token = pad_token = None

    template = ChatTemplate.for_tokenizer(Bare())
    assert template.source.endswith("chat_fallback.jinja")
    assert template.render([{"role": "user", "content": "hi"}]) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_sandbox_blocks_unsafe_templates() -> None:
    from tidal.app.chat_template import ChatTemplateError

    class Evil:
        chat_template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
        bos_token = eos_token = unk_token = pad_token = None

    with pytest.raises(ChatTemplateError):
        ChatTemplate.for_tokenizer(Evil()).render([{"role": "user", "content": "x"}])


# -- the app around a dying engine ------------------------------------------------------------
def test_engine_death_gives_errors_not_hangs(model_dir: Path) -> None:
    engine = AsyncEngine(_engine_config(model_dir))
    app = build_app(engine, ServerSettings(served_model_name="tiny"))
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200

        def crash() -> list:
            raise RuntimeError("device lost")

        engine.core.step = crash  # type: ignore[method-assign]
        body = {"model": "tiny", "messages": CHAT, "max_tokens": 4, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            raw = b"".join(resp.iter_bytes())
        events = SSE_EVENT.findall(raw)
        assert events[-1] == b"[DONE]"
        assert "error" in orjson.loads(events[-2])
        health = client.get("/health")
        assert health.status_code == 503 and "error" in health.json()
        again = client.post("/v1/chat/completions", json={**body, "stream": False})
        assert again.status_code == 503 and again.json()["error"]["code"] == "engine_dead"


def test_cors_is_off_unless_origins_are_allowed_and_405_names_the_methods(
        model_dir: Path) -> None:
    page = "http://page.example"
    preflight = {"Origin": page, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    for origins in ([], [page]):
        app = build_app(AsyncEngine(_engine_config(model_dir)),
                        ServerSettings(served_model_name="tiny", allowed_origins=origins))
        with TestClient(app) as client:
            allowed = client.get("/v1/models", headers={"Origin": page}).headers.get(
                "access-control-allow-origin")
            options = client.options("/v1/completions", headers=preflight)
            assert allowed == (page if origins else None)
            # without CORS a foreign page's preflight is refused by the guard (app/guard.py)
            assert options.status_code == (200 if origins else 403)
            wrong = client.get("/v1/completions")
            assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
            assert wrong.json()["error"]["message"]


# -- the CLI ----------------------------------------------------------------------------------
def test_parse_bytes() -> None:
    assert parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("2GiB") == 2 << 30
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("4096") == 4096
    for bad in ("lots", "0", "-1GiB", "3 parsecs"):
        with pytest.raises(Exception, match="byte size|positive"):
            parse_bytes(bad)


def test_token_budget_defaults_by_device(model_dir: Path) -> None:
    """A CPU step costs the same per token past a few hundred, so a CPU takes a small budget."""
    def budget(**kwargs: Any) -> int | None:
        return EngineConfig(model=str(model_dir), **kwargs).max_num_batched_tokens

    assert (budget(), budget(device="cuda"), budget(max_num_batched_tokens=64)) == (192, 2048, 64)
    assert (budget(offline=True), budget(offline=True, device="cuda")) == (1024, 2048)
    assert build_parser().parse_args(["serve"]).max_num_batched_tokens is None  # the config's


def test_cli_flags(model_dir: Path) -> None:
    args = build_parser().parse_args([
        "serve", "--model", str(model_dir), "--host", "0.0.0.0", "--port", "9000",
        "--device", "cpu", "--dtype", "float32", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "512", "--max-model-len", "256", "--kv-cache-memory", "64MiB",
        "--no-enable-prefix-caching", "--api-key", "k", "--served-model-name", "tiny",
        "--allowed-origins", "http://a.example", "http://b.example"])
    assert args.allowed_origins == ["http://a.example", "http://b.example"]
    assert (args.host, args.port, args.max_num_seqs, args.max_model_len) == ("0.0.0.0", 9000, 8,
                                                                             256)
    assert args.kv_cache_memory == 64 << 20 and args.enable_prefix_caching is False
    assert (args.api_key, args.served_model_name, args.dtype) == ("k", "tiny", "float32")
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for flag in ("--model", "--host", "--port", "--device", "--dtype", "--max-num-seqs",
                 "--max-num-batched-tokens", "--max-model-len", "--kv-cache-memory",
                 "--enable-prefix-caching", "--no-enable-prefix-caching", "--api-key",
                 "--served-model-name"):
        assert flag in help_text


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    """``tidal --version`` prints the package's version, the one pyproject.toml declares."""
    pyproject = ROOT / "pyproject.toml"
    declared = re.search(r'^version = "([^"]+)"', pyproject.read_text(), re.M)
    assert package_version() == declared.group(1)
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"tidal {declared.group(1)}"


def test_serve_help_groups_flags_by_topic() -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    groups = {g.title: [a.dest for a in g._group_actions] for g in serve._action_groups}
    assert groups["model"] == ["model", "tokenizer", "served_model_name", "dtype", "quantization",
                               "quantization_group_size", "max_model_len", "runner"]
    assert groups["server"] == ["host", "port"]
    assert "max_num_batched_tokens" in groups["engine and scheduler"]
    assert {"device", "cpu_kernels", "enforce_eager"} <= set(groups["device (CPU and GPU)"])
    assert groups["API and security"] == ["api_key", "metrics_without_key", "allowed_origins",
                                          "allowed_hosts", "max_request_bytes",
                                          "request_body_timeout"]
    assert groups["chat and tools"] == ["chat_template", "tool_call_parser", "reasoning_parser"]
    assert groups["logging"] == ["log_level", "enable_request_tracing", "otlp_traces_endpoint"]
    assert "request_timeout" in groups["engine and scheduler"]


def test_banner_urls() -> None:
    def url(host: str) -> str:
        return base_url(ServerSettings(served_model_name="m", host=host, port=8000))

    assert url("127.0.0.1") == "http://127.0.0.1:8000"
    assert url("0.0.0.0") == "http://127.0.0.1:8000"  # a wildcard bind: reached on loopback
    assert url("::") == "http://[::1]:8000"
    assert url("example.internal") == "http://example.internal:8000"


def test_chat_template_kwargs_reach_the_template(state: ServerState, tmp_path: Path) -> None:
    template = tmp_path / "thinking.jinja"
    template.write_text("{% if enable_thinking is defined and not enable_thinking %}[no think]"
                        "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")
    state.chat_template = ChatTemplate.for_tokenizer(state.tokenizer, str(template))
    body = {"model": "tiny", "messages": CHAT}
    assert prepare_chat_request(body, state).prompt == "Tell me a joke"
    off = prepare_chat_request({**body, "chat_template_kwargs": {"enable_thinking": False}},
                               state)
    assert off.prompt == "[no think]Tell me a joke"
    with pytest.raises(ApiError) as info:
        prepare_chat_request({**body, "chat_template_kwargs": {"messages": []}}, state)
    assert info.value.param == "chat_template_kwargs" and "messages" in str(info.value)
