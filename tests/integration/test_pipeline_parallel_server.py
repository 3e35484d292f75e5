"""A real server over two pipeline stages on the CPU, in one start: it serves the tokens one
process gives, to the ``openai`` client and to ``curl -N`` (``live_server.curl``); then a
stage's worker is killed mid-generation, and the stream ends with an error event and
``[DONE]``, ``/health`` turns 503, the server exits non-zero and no process of it is left (as
``test_tensor_parallel_server.py`` checks for tensor-parallel ranks, whose helpers this
reuses)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import openai
import pytest

from tests.integration.test_tensor_parallel_server import (
    PROMPTS,
    _alive,
    _children,
    _health,
    _stream,
    _workers,
    model,  # noqa: F401 - the module's model fixture
)
from tests.live_server import curl, running_server, sse_events
from tidal.core import LLM, SamplingParams

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_two_stages_serve_the_tokens_of_one_process_and_fail_loudly(model):  # noqa: F811
    llm = LLM(str(model), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    with running_server(model, "--pipeline-parallel-size", "2") as srv:
        workers = _workers(srv.proc.pid)
        assert len(workers) == 2
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        got = client.completions.create(model=str(model), prompt=PROMPTS, max_tokens=16,
                                        temperature=0.0, extra_body={"ignore_eos": True})
        assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == want
        body = json.dumps({"model": str(model), "prompt": PROMPTS[0], "max_tokens": 16,
                           "temperature": 0, "ignore_eos": True, "stream": True})
        events = sse_events(curl("-H", "Content-Type: application/json", "-d", body,
                                 srv.url + "/v1/completions"))
        assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == want[0]

        children = _children(srv.proc.pid)  # the workers and multiprocessing's helpers
        out: list[bytes] = []
        reader = threading.Thread(target=_stream, args=(srv.url, model, out))
        reader.start()
        time.sleep(3.0)  # the stream is under way
        assert reader.is_alive(), f"the stream ended early: {out}"
        os.kill(workers[1], signal.SIGKILL)  # the last stage's
        killed = time.monotonic()
        while _health(srv.url) != 503:
            assert time.monotonic() - killed < 2.0, "/health did not turn 503 within 2 s"
            time.sleep(0.05)
        reader.join(30)
        events = sse_events(out[0])
        assert events[-1] == b"[DONE]"
        assert "error" in events[-2], events[-2]
        assert any(e["choices"] for e in events[:-2] if "choices" in e), "no token came first"
        assert srv.proc.wait(30) != 0, "the server should exit non-zero"
        time.sleep(0.5)
        assert not [p for p in children if _alive(p)], "a process outlived its server"
