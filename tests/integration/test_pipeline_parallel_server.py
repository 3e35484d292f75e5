"""A real server over two pipeline stages on the CPU, in one start: it serves the tokens one
process gives, to the ``openai`` client and to ``curl -N`` (``live_server.curl``); then a
stage's worker is killed mid-generation, and the stream ends with an error event and
``[DONE]``, ``/health`` turns 503, the server exits non-zero and no process of it is left (as
``test_tensor_parallel_server.py`` checks for tensor-parallel ranks, whose helpers this
reuses)."""

from __future__ import annotations

import pytest

from tests.integration.test_tensor_parallel_server import (
    _workers,
    assert_a_killed_worker_fails_loudly,
    assert_serves_one_process_tokens,
    model,  # noqa: F401 - the module's model fixture
)
from tests.live_server import running_server

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_two_stages_serve_the_tokens_of_one_process_and_fail_loudly(model):  # noqa: F811
    with running_server(model, "--pipeline-parallel-size", "2") as srv:
        workers = _workers(srv.proc.pid)
        assert len(workers) == 2
        assert_serves_one_process_tokens(srv, model)
        assert_a_killed_worker_fails_loudly(srv, model, workers[1])  # the last stage's
