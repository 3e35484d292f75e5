"""``bench/busy_start.py`` end to end at tiny sizes: a quiet first start and one beside a
co-tenant, each on a cold plan cache of its own, measured alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench.common
from bench import busy_start


@pytest.mark.slow
def test_busy_start_on_a_tiny_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tidal.gpu.random_model import build_model_dir

    model = build_model_dir(tmp_path / "tiny", "llama", max_position_embeddings=512)
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path)
    busy_start.main(["--model", str(model), "--serve-s", "3", "--concurrency", "1", "2",
                     "--input-len", "16", "--output-len", "8", "--name", "smoke"])
    result = json.loads((tmp_path / "smoke.json").read_text())
    for start in ("quiet", "busy"):
        run = result[start]
        assert run["plans_swapped_in_s"] is not None  # timed in the background, then swapped
        assert any("timed" in table for table in run["plans"])
        assert all(f["failed"] == 0 and f["output_tok_s"] > 0 for f in run["figures"].values())
    assert result["busy"]["busy_first_start"] and set(result["busy_over_quiet"]) == {"c1", "c2"}
