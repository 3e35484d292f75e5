"""``bench/window_decode.py`` on a tiny Gemma-3-shaped model: the sliding layers' blocks
held stay at their window's while the full layers' grow with the context."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench.common
from bench import window_decode


def test_window_decode_on_a_tiny_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path)
    window_decode.main(["--tiny", "--short", "96", "--long", "384", "--name", "smoke"])
    result = json.loads((tmp_path / "smoke.json").read_text())
    short, long = result["runs"]
    assert long["full_blocks_held"] >= 384 // result["block_size"] > short["full_blocks_held"]
    # a window of 32 tokens, decoded a token a step: at most 3 blocks of 16 at once
    assert 0 < long["window_blocks_held"] <= 3 and short["window_blocks_held"] <= 3
    assert result["long_over_short"] > 0 and long["decode_tok_s"] > 0
