"""``bench/kv_tier.py`` end to end at tiny sizes: every run finished and was measured; the
chats' returning turns hit the tiers, and the preempting batch resumed by each method."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench.common
from bench import kv_tier


@pytest.mark.slow
def test_kv_tier_on_a_tiny_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tidal.gpu.random_model import build_model_dir

    model = build_model_dir(tmp_path / "tiny", "llama", max_position_embeddings=512)
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path)
    kv_tier.main(["--model", str(model), "--kv-cache-blocks", "6", "--host-blocks", "32",
                  "--disk-blocks", "64", "--conversations", "3", "--turns", "2",
                  "--turn-len", "40", "--reply-len", "2", "--concurrency", "3",
                  "--preempt-kv-cache-blocks", "6", "--prompt-len", "24", "--output-len", "24",
                  "--name", "smoke"])
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert result["machine"]["cpu_cores"]
    assert result["chat"]["no_tier"]["host_tier_hits"] == 0
    assert result["chat"]["host"]["host_tier_hits"] > 0
    assert result["chat"]["host_and_disk"]["disk_tier_hits"] > 0
    for method in ("swap", "recompute"):
        run = result["preemption"][method]
        assert run["preemptions"] > 0 and run["resumptions"].get(method, 0) > 0
    assert result["returning_ttft_p50_host_over_no_tier"] > 0  # both of the ratios
    assert result["swap_over_recompute_tok_s"] > 0
