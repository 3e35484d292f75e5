"""``bench/priority_mix.py`` end to end at tiny sizes: both policies served every request of
both classes, and the urgent class's ratio is reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench.common
from bench import priority_mix


@pytest.mark.slow
def test_priority_mix_on_a_tiny_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tidal.gpu.random_model import build_model_dir

    model = build_model_dir(tmp_path / "tiny", "llama", max_position_embeddings=512)
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path)
    priority_mix.main(["--model", str(model), "--num-requests", "20", "--rate", "40",
                       "--input-len", "16", "--output-len", "4", "--max-num-seqs", "2",
                       "--name", "smoke"])
    result = json.loads((tmp_path / "smoke.json").read_text())
    for run in result["runs"].values():
        assert {c: r["completed"] for c, r in run["classes"].items()} == {"urgent": 2,
                                                                         "normal": 18}
    assert result["urgent_over_normal_ttft_p99"] > 0
