"""``bench/attack_latency.py`` end to end with tiny durations: a real server on the embedded
model, two attacks of a second each, and the result's shape. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench.attack_latency as attack_latency
import bench.common

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_attack_latency_runs_and_writes_its_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path)
    attack_latency.main(["--seconds", "1", "--ramp", "0.2", "--attacks", "prompts", "chunked",
                         "--wait-load", "0", "--name", "attack"])
    result = json.loads((tmp_path / "attack.json").read_text())
    assert result["benchmark"] == "attack" and result["machine"]["cpu_cores"]
    assert len(result["load_average_before"]) == 3 and "server_busy_after" in result
    assert result["settings"]["seconds_per_attack"] == 1
    unloaded = result["unloaded"]
    assert unloaded["health_ms"]["n"] >= 50 and unloaded["completion_s"]["n"] >= 5
    assert list(result["attacks"]) == ["prompts", "chunked"]
    for name, run in result["attacks"].items():
        assert run["health_ms"]["n"] >= 1 and run["health_ms"]["max"] >= run["health_ms"]["p50"]
        assert run["completion_s"]["n"] >= 1, name
        assert run["completion_s"]["ratio_max"] >= run["completion_s"]["ratio_median"] > 0
        assert isinstance(run["health_within_target"], bool)
        assert isinstance(run["completion_within_target"], bool)
        attacker = run["attacker"]
        assert attacker["requests"] >= 1 and attacker["bytes_sent"] > 0, attacker
        assert attacker["server_cpu_s"] >= 0 and attacker["settle_s"] >= 0
        assert isinstance(attacker["settled"], bool)
    # the caps answered the attacker: too many prompts, a body past the cap
    assert "400" in result["attacks"]["prompts"]["attacker"]["outcomes"]
    assert result["attacks"]["prompts"]["attacker"]["prompts"] > 800_000
    table = capsys.readouterr().out
    assert "| prompts |" in table and "| chunked |" in table and "| unloaded |" in table
