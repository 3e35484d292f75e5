"""The GPU decode benchmarks' smoke mode on the CPU (tiny models in the real shapes'
architectures, every measurement taken, results written) and the CPU prefill and decode
attention benchmarks. No timing is asserted."""

from __future__ import annotations

import json

import pytest
import torch

import bench.common
from bench import decode_attention, decode_roofline, matmul_roofline, overlap, prefill_attention
from bench.model_shapes import SHAPES, build_shaped_model_dir, weight_bytes
from tidal.gpu.cpu.kernels import target_isa
from tidal.gpu.model_config import ModelConfig


def test_shaped_model_dirs_keep_the_architecture(tmp_path):
    path = build_shaped_model_dir(tmp_path / "llama", "llama-3.2-1b", tiny=True,
                                  dtype=torch.float32)
    cfg = ModelConfig.from_dir(path)
    assert cfg.architecture == "LlamaForCausalLM" and cfg.tie_word_embeddings
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_theta == 500000.0
    assert cfg.num_heads // cfg.num_kv_heads == 2


def test_weight_bytes_count_a_tied_head_once():
    model = torch.nn.Module()
    model.embed_tokens = torch.nn.Embedding(10, 4)
    model.lm_head = torch.nn.Linear(4, 10, bias=False)
    model.proj = torch.nn.Linear(4, 4, bias=False)
    assert weight_bytes(model) == (40 + 16) * 4
    model.lm_head.weight = model.embed_tokens.weight
    assert weight_bytes(model) == (40 + 16) * 4


@pytest.mark.slow
def test_decode_roofline_and_overlap_smoke(tmp_path, monkeypatch):
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path / "results")
    common = ["--device", "cpu", "--tiny", "--batches", "1,3", "--steps", "3", "--warmup",
              "1", "--context", "20", "--model-root", str(tmp_path / "models")]
    path = decode_roofline.main(common)
    result = json.loads(path.read_text())
    assert path.name == "decode_roofline-cpu-tiny.json"
    assert set(result["shapes"]) == set(SHAPES)
    for shape in result["shapes"].values():
        assert [r["batch"] for r in shape["rows"]] == [1, 3]
        assert all(r["step_ms"] > 0 and r["roofline_ms"] > 0 for r in shape["rows"])

    path = overlap.main(common)
    rows = json.loads(path.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 3]
    assert all(r["step_ms_overlap_on"] > 0 and r["gpu_ms"] > 0 for r in rows)


def test_matmul_roofline_smoke(tmp_path, monkeypatch):
    """Every GEMM of the shape at each batch, the matmul rate and a prefill chunk measured;
    the prefill's FLOPs counted as its linears' and causal attention's."""
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path / "results")
    result = matmul_roofline.main(["--device", "cpu", "--tiny", "--batches", "1,3", "--chunk",
                                   "16", "--peak-size", "64", "--model-root",
                                   str(tmp_path / "models")])
    assert result["path"].endswith("matmul_roofline-llama-3.2-1b-cpu-tiny.json")
    gemms = {(r["gemm"], r["batch"]) for r in result["gemms"]}
    assert gemms == {(g, b) for g in ("qkv", "o", "gate_up", "down", "lm_head") for b in (1, 3)}
    assert all(r["us"] > 0 and r["bytes"] > 0 for r in result["gemms"])
    prefill = result["prefill"]
    assert prefill["ms"] > 0 and prefill["of_matmul_rate"] > 0
    # tiny llama: 2 layers, hidden 64, 4 heads of 16 (2 KV), MLP 128
    layers, tokens = 2, 16
    linears = layers * 2 * tokens * (128 * 64 + 64 * 64 + 256 * 64 + 64 * 128)
    attention = layers * 2 * 2 * 4 * 16 * tokens * (tokens + 1) / 2
    assert prefill["flops"] == linears + attention


def test_prefill_attention_benchmark_smoke(tmp_path, monkeypatch):
    """Every layout timed on both paths, and the two agree."""
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path / "results")
    result = prefill_attention.main(["--repeats", "1", "--name", "smoke"])
    assert json.loads((tmp_path / "results" / "smoke.json").read_text())["runs"]
    assert [r["layout"] for r in result["runs"]] == list(prefill_attention.layouts())
    for run in result["runs"]:
        assert run["kernel_ms"] > 0 and run["torch_ms"] > 0 and run["max_abs_diff"] < 1e-5


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_decode_attention_benchmark_smoke(tmp_path, monkeypatch, dtype, tolerance):
    """The in-cache layouts timed on both paths, which agree; the result named for the ISA the
    kernels are built for (where not this CPU's) and the dtype."""
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path / "results")
    layouts = [name for name in decode_attention.LAYOUTS if name.endswith("in cache")]
    result = decode_attention.main(["--repeats", "1", "--dtype", dtype, "--layouts", *layouts])
    isa = target_isa()
    name = "-".join(["decode_attention"] + ([] if isa == "native" else [isa])
                    + ([] if dtype == "float32" else [dtype]))
    assert json.loads((tmp_path / "results" / f"{name}.json").read_text())["dtype"] == dtype
    assert [r["layout"] for r in result["runs"]] == layouts
    for run in result["runs"]:
        assert run["kernel_ms"] > 0 and run["torch_ms"] > 0 and run["max_abs_diff"] < tolerance
