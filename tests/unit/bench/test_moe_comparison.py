"""The MoE serving target's pieces (issue 51): the Qwen3-30B-A3B shape, its tiny variant as
HF transformers builds it, the servers' resident memory, and a comparison run of tidal alone
in int4 on the tiny MoE through ``bench.serving_comparison``'s main. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import bench.common
import bench.serving_comparison as harness
from bench.comparison_model import shape_dir
from bench.model_shapes import shape_settings
from bench.processes import memory_mb, tree_memory_mb
from bench.serving_report import memory_table

SHAPE = "qwen3-30b-a3b"


def test_the_moe_shape_is_qwen3_30b_a3b_with_fewer_layers() -> None:
    """Qwen3-30B-A3B's published config.json, but for the layer count."""
    s = shape_settings(SHAPE)
    real = dict(model_type="qwen3_moe", hidden_size=2048, moe_intermediate_size=768,
                num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                vocab_size=151936, rope_theta=1000000.0, tie_word_embeddings=False,
                rms_norm_eps=1e-6, decoder_sparse_step=1, mlp_only_layers=[])
    assert {k: s[k] for k in real} == real
    assert s["num_hidden_layers"] < 48
    assert shape_dir(SHAPE, True, "bfloat16", "/x").name == f"tidal-bench-{SHAPE}-tiny-bfloat16"
    tiny = shape_settings(SHAPE, tiny=True)
    assert tiny["num_experts"] > tiny["num_experts_per_tok"] > 1
    assert tiny["hidden_size"] < 2048 and tiny["moe_intermediate_size"] < 768


def test_tree_memory_counts_the_children() -> None:
    """A child holding 64 MB more than a bare interpreter shows in the tree's resident set."""
    child = subprocess.Popen([sys.executable, "-c",
                              "import sys, time; b = bytearray(64 << 20); "
                              "print(1, flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"1"
        own = memory_mb(child.pid)["rss_mb"]
        mine, tree = memory_mb(os.getpid())["rss_mb"], tree_memory_mb(os.getpid())
        assert own > 64
        assert tree["main_rss_mb"] == pytest.approx(mine, abs=16)
        assert tree["rss_mb"] >= tree["main_rss_mb"] + own - 16
        assert tree["peak_rss_mb"] >= tree["rss_mb"] - 16
    finally:
        child.kill()
        child.wait()


def test_memory_table_ratio_is_ours_over_the_peer() -> None:
    runs = {"tidal": {"memory_after_load": {"rss_mb": 1900.0, "peak_rss_mb": 5000.0},
                      "memory_at_end": {"rss_mb": 2200.0, "peak_rss_mb": 5000.0}},
            "llamacpp": {"memory_after_load": {"rss_mb": 1800.0, "peak_rss_mb": 1800.0},
                         "memory_at_end": {"rss_mb": 2000.0, "peak_rss_mb": 2000.0}},
            "vllm": {"skipped": "not installed"}}
    table = memory_table(runs)
    assert "| tidal | 1900.0 | 2200.0 | 5000.0 | - |" in table
    assert "| llamacpp | 1800.0 | 2000.0 | 2000.0 | 1.10x |" in table
    assert "vllm" not in table
    assert memory_table({"tidal": {}}) == ""


@pytest.mark.slow
def test_comparison_run_on_the_tiny_moe_in_int4(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path)
    start = time.monotonic()
    path = harness.main(["--shape", SHAPE, "--tiny", "--shape-dtype", "bfloat16",
                         "--shape-dir", str(tmp_path), "--peer", "none",
                         "--concurrency", "1", "2", "--input-lens", "16", "--output-len", "4",
                         "--shared-prefix-len", "0", "--num-long", "0", "--warmup", "1",
                         "--no-scenario-warmup", "--no-plots", "--name", "moe-smoke",
                         "--server-arg=--quantization=int4", "--server-arg=--cpu-kernels=force",
                         "--server-arg=--kv-cache-memory=8MiB"])
    result = json.loads(path.read_text())
    setup = result["setup"]
    assert setup["model"] == str(tmp_path / f"tidal-bench-{SHAPE}-tiny-bfloat16")
    _check_moe_to_transformers(Path(setup["model"]))
    assert [s["name"] for s in result["scenarios"]] == ["c1-in16", "c2-in16"]
    for scenario in result["scenarios"]:
        report = scenario["reports"]["tidal"]["classes"]["all"]
        assert report["failed"] == 0 and report["completed"] == 4, report["errors"]
        assert report["output_tokens_per_request"]["min"] == 4
    tidal = setup["runs"]["tidal"]
    for when in ("memory_after_load", "memory_at_end"):
        assert 100 < tidal[when]["rss_mb"] <= tidal[when]["peak_rss_mb"]
    text = (tmp_path / "moe-smoke.md").read_text()
    assert "## Resident memory" in text and "| tidal | " in text
    print(f"tiny MoE comparison: {time.monotonic() - start:.1f} s")


def _check_moe_to_transformers(path: Path) -> None:
    """HF transformers loads the tiny shape's directory as a MoE of several experts."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert model.dtype == torch.bfloat16
    blocks = [m for m in model.modules() if isinstance(m, Qwen3MoeSparseMoeBlock)]
    assert len(blocks) == model.config.num_hidden_layers == 2
    assert blocks[0].experts.gate_up_proj.shape == (8, 2 * 32, 64)
    assert model.config.num_experts_per_tok == 2 and model.config.norm_topk_prob
    assert not model.config.tie_word_embeddings
