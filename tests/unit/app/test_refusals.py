"""A client whose requests keep being refused waits before its next body is read, then gets a
429 that closes its connection; another client is not held (app/refusals.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from tests.unit.app.test_api_unit import _engine_config, model_dir  # noqa: F401
from tidal.app.errors import ApiError
from tidal.app.refusals import REFUSAL_BYTES, RefusalMeter, refusal_cost
from tidal.app.routes import build_app
from tidal.app.server_state import ServerSettings
from tidal.core.async_engine import AsyncEngine


def test_refusals_within_the_rate_never_wait():
    meter = RefusalMeter(rate=100.0, burst=4)
    for _ in range(3):
        meter.record("a")
    assert meter.wait_for("a") == 0.0  # room for the fourth of the burst
    meter.record("a")
    assert 0.0 < meter.wait_for("a") <= 0.01 + 1e-9
    assert meter.wait_for("someone else") == 0.0


def test_a_refused_large_body_counts_as_many_refusals():
    assert refusal_cost({}) == refusal_cost({"content-length": "900"}) == 1.0
    assert refusal_cost({"content-length": str(8 * REFUSAL_BYTES)}) == 8.0
    assert refusal_cost({"content-length": "lots"}) == 1.0
    meter = RefusalMeter(rate=100.0, burst=16)
    meter.record("a", refusal_cost({"content-length": str(8 * REFUSAL_BYTES)}))
    meter.record("a", 8.0)
    assert meter.wait_for("a") > 0.0  # two large bodies drained the burst of 16
    meter.record("b", 1000.0)  # at most a burst: it waits a burst's refill, no more
    assert meter.wait_for("b") <= 17 / 100.0


async def test_a_client_past_its_rate_waits_then_goes_on():
    meter = RefusalMeter(rate=20.0, burst=1, max_wait=1.0)
    meter.record("a")
    start = time.monotonic()
    await meter.hold("a")  # its bucket refills in 1 / 20 s
    assert 0.03 <= time.monotonic() - start < 0.5


async def test_a_deep_debt_gets_a_429_that_closes_the_connection():
    meter = RefusalMeter(rate=1.0, burst=8, max_wait=0.05)
    for _ in range(20):
        meter.record("a")
    with pytest.raises(ApiError) as info:
        await meter.hold("a")
    err = info.value
    assert err.status == 429 and err.code == "too_many_refusals"
    assert err.headers == {"Retry-After": "9", "Connection": "close"}  # 8 owed + the next


async def test_past_max_held_the_429_comes_at_once():
    meter = RefusalMeter(rate=1.0, burst=2, max_wait=5.0, max_held=1)
    for _ in range(6):
        meter.record("a")
    waiting = asyncio.create_task(meter.hold("a"))
    await asyncio.sleep(0.01)
    start = time.monotonic()
    with pytest.raises(ApiError):
        await meter.hold("a")
    assert time.monotonic() - start < 0.1
    waiting.cancel()


def test_a_client_sending_bad_requests_is_slowed_and_another_is_not(
        model_dir: Path) -> None:  # noqa: F811
    """Under --fair-share-by api-key, the key that sent 4 bad bodies in a row then waits or
    gets the 429; a request with another key is answered at once."""
    app = build_app(AsyncEngine(_engine_config(model_dir)),
                    ServerSettings(served_model_name="tiny", fair_share_by="api-key"))
    bad = {"model": "tiny", "prompt": "hi", "temperature": "hot"}
    good = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    attacker, other = ({"Authorization": f"Bearer {k}"} for k in ("attacker", "other"))
    with TestClient(app) as client:
        app.state.tidal.refusals = RefusalMeter(rate=0.5, burst=4, max_wait=0.2)
        codes = [client.post("/v1/completions", json=bad, headers=attacker).status_code
                 for _ in range(4)]
        assert codes == [400] * 4
        start = time.monotonic()
        held = client.post("/v1/completions", json=good, headers=attacker)
        assert time.monotonic() - start >= 0.15
        assert held.status_code == 429 and held.headers["connection"] == "close"
        assert held.json()["error"]["code"] == "too_many_refusals"
        start = time.monotonic()
        assert client.post("/v1/completions", json=good, headers=other).status_code == 200
        assert time.monotonic() - start < 5.0
