"""A first start on a model this host has no CPU plans for answers within seconds: it serves
on untimed defaults while the plans are timed in the background, then swaps them in, and the
tokens go on the same. The next start reads the plans back."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest

from bench.processes import LaunchedServer
from tests.live_server import DEVICE_ARGS
from tidal.gpu.cpu.selector import CACHE_ENV
from tidal.gpu.random_model import build_model_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]
FIRST_ANSWER_S = 15.0  # from launch, on a cold plan cache
AUTO = ["--cpu-kernels", "auto"]  # plans timed (the suite's servers take force)


class ColdCacheServer(LaunchedServer):
    """``tidal serve`` with its plan cache in ``cache_dir``."""

    def __init__(self, model: str, args: list[str], cache_dir: Path) -> None:
        self.cache_dir = cache_dir
        super().__init__(model, args)

    def env(self) -> dict[str, str]:
        return {**super().env(), CACHE_ENV: str(self.cache_dir)}

    def logged(self) -> str:
        return Path(self.log.name).read_text(errors="replace")


def _complete(url: str) -> list[str]:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as resp:
        model = json.loads(resp.read())["data"][0]["id"]
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 0}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.loads(resp.read())["choices"][0]["logprobs"]["tokens"]


def _first_answer(server: ColdCacheServer, launched: float) -> tuple[float, list[str]]:
    server.wait_ready(120)
    tokens = _complete(server.url)
    return time.monotonic() - launched, tokens


@pytest.mark.skipif(DEVICE_ARGS != [], reason="the CPU's plans")
def test_a_cold_plan_cache_answers_within_seconds(tmp_path: Path) -> None:
    # the benchmark Llama's shape: its plans take many seconds to time on two cores
    model = build_model_dir(tmp_path / "model", "llama", hidden_size=512,
                            intermediate_size=1536, num_hidden_layers=8,
                            num_attention_heads=8, num_key_value_heads=8,
                            max_position_embeddings=1024)
    cache = tmp_path / "plans"
    launched = time.monotonic()
    server = ColdCacheServer(str(model), AUTO, cache)
    try:
        took, tokens = _first_answer(server, launched)
        log = server.logged()
        assert took < FIRST_ANSWER_S, log
        assert "plans are timed in the background" in log, log[-3000:]
        deadline = time.monotonic() + 400
        while "serving on the upgraded CPU model" not in server.logged():
            assert time.monotonic() < deadline, server.logged()
            _complete(server.url)  # steps: the swap happens between two
            time.sleep(0.5)
        assert _complete(server.url) == tokens  # the same greedy tokens after the swap
    finally:
        server.stop()
    again = ColdCacheServer(str(model), AUTO, cache)
    try:
        again.wait_ready(120)
        assert _complete(again.url) == tokens
        assert "timed in the background" not in again.logged()
        assert "from this host's cache" in again.logged()
    finally:
        again.stop()
