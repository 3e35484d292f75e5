"""Model files are checked before anything is built from them (gpu/model_checks.py): a config
the weights do not back, a damaged GGUF or safetensors file, a context the memory cannot hold,
each fails (or is clamped) in seconds with an error naming the file and the field."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from tests.gguf_writing import write_gguf
from tests.live_server import running_server
from tests.paths import ROOT
from tidal.core.config import EngineConfig, load_tokenizer
from tidal.gpu.model_checks import (
    ModelFileError,
    check_against_checkpoint,
    fit_context,
    position_table_bytes,
)
from tidal.gpu.model_config import ModelConfig

FAST_S = 10.0  # generous: each check reads headers only


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tidal.gpu.random_model import build_model_dir

    return build_model_dir(tmp_path_factory.mktemp("checks") / "tiny", "llama")


@pytest.fixture(scope="module")
def gguf_path(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("checks_gguf") / "tiny.gguf"
    write_gguf(model_dir, path, "llama", {})
    return path


def _with_config(model_dir: Path, dest: Path, **changes: object) -> Path:
    shutil.copytree(model_dir, dest)
    raw = json.loads((model_dir / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**raw, **changes}))
    return dest


def _check(model: Path) -> None:
    check_against_checkpoint(model, ModelConfig.load(model))


def _fails_fast(model: Path, match: str) -> None:
    started = time.monotonic()
    with pytest.raises(ValueError, match=match):
        _check(model)
    assert time.monotonic() - started < FAST_S


def test_good_files_pass(model_dir: Path, gguf_path: Path) -> None:
    for model in (model_dir, gguf_path):
        assert check_against_checkpoint(model, ModelConfig.load(model)) > 0


@pytest.mark.parametrize(("changes", "match"), [
    ({"num_hidden_layers": 10**6}, r"num_hidden_layers is 1,000,000; expected 1 to 4,096"),
    ({"num_hidden_layers": 3}, r"num_hidden_layers is 3, but the weights hold 2 \(0 to 1\)"),
    ({"num_hidden_layers": 1}, r"num_hidden_layers is 1, but the weights hold 2"),
    ({"hidden_size": 128}, r"embed_tokens.weight is \[512, 64\].*make it \[512, 128\]"),
    ({"intermediate_size": 256}, r"gate_proj.weight is \[128, 64\].*make it \[256, 64\]"),
    ({"num_key_value_heads": 4}, r"k_proj.weight is \[32, 64\].*make it \[64, 64\]"),
    ({"num_key_value_heads": 3}, r"not a multiple of num_key_value_heads 3"),
    ({"vocab_size": "many"}, r"vocab_size must be an integer, got 'many'"),
    ({"hidden_size": -64}, r"hidden_size is -64; expected 1 to"),
    ({"max_position_embeddings": 2**40}, r"max_position_embeddings is .*; expected 1 to"),
    ({"rope_parameters": [1, 2], "rope_scaling": [1, 2]}, r"rope_scaling must be an object"),
])
def test_config_the_weights_do_not_back_fails_fast(model_dir: Path, tmp_path: Path,
                                                    changes: dict, match: str) -> None:
    model = _with_config(model_dir, tmp_path / "m", **changes)
    _fails_fast(model, r"config\.json|model\.safetensors")
    _fails_fast(model, match)


def test_gguf_block_count_the_tensors_do_not_back(gguf_path: Path, tmp_path: Path) -> None:
    """block_count 10**6 in the metadata of a two-layer file: refused by the range check;
    a plausible wrong count by the tensor index."""
    raw = gguf_path.read_bytes()
    key = b"llama.block_count"
    at = raw.index(key) + len(key) + 4  # the value's type (uint32) comes first
    for count, match in ((10**6, r"num_hidden_layers is 1,000,000"),
                         (3, r"num_hidden_layers is 3, but the weights hold 2")):
        path = tmp_path / f"blocks{count}.gguf"
        path.write_bytes(raw[:at] + np.uint32(count).tobytes() + raw[at + 4:])
        _fails_fast(path, match)
        _fails_fast(path, str(path))


@pytest.mark.parametrize("cut", [10, 200, 0.5, -100])
def test_truncated_gguf_names_the_file(gguf_path: Path, tmp_path: Path, cut: float) -> None:
    raw = gguf_path.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(raw[:int(len(raw) * cut) if isinstance(cut, float) else cut])
    started = time.monotonic()
    for load in (lambda: ModelConfig.load(path),
                 lambda: load_tokenizer(EngineConfig(model=str(path)))):
        with pytest.raises(ValueError) as info:
            load()
        message = str(info.value)
        assert str(path) in message and ("damaged or truncated" in message), message
    assert time.monotonic() - started < FAST_S


def test_gguf_without_tokens_says_which_metadata(gguf_path: Path, tmp_path: Path) -> None:
    raw = gguf_path.read_bytes()
    path = tmp_path / "notokens.gguf"
    # renaming the key keeps every offset: the parser sees a file without tokenizer.ggml.tokens
    path.write_bytes(raw.replace(b"tokenizer.ggml.tokens", b"tokenizer.ggml.tokenz", 1))
    with pytest.raises(ValueError, match=r"notokens\.gguf: no tokenizer.*tokenizer\.ggml\."):
        load_tokenizer(EngineConfig(model=str(path)))


@pytest.mark.parametrize("cut", [4, 100, 0.5])
def test_truncated_safetensors_names_the_file(model_dir: Path, tmp_path: Path,
                                              cut: float) -> None:
    model = _with_config(model_dir, tmp_path / "m")
    weights = model / "model.safetensors"
    raw = weights.read_bytes()
    weights.write_bytes(raw[:int(len(raw) * cut) if isinstance(cut, float) else cut])
    _fails_fast(model, r"model\.safetensors: not a readable safetensors file \(damaged")


def test_context_the_memory_cannot_hold_is_clamped_or_refused(model_dir: Path) -> None:
    cfg = ModelConfig.load(model_dir)
    cfg.max_position_embeddings = 2**26
    memory = 4 << 30
    length = fit_context(EngineConfig(model=str(model_dir)), cfg, 0, 4, memory=memory)
    assert 1024 <= length < 2**26
    assert position_table_bytes(cfg, length) <= memory // 16
    with pytest.raises(ModelFileError, match=r"--max-model-len 67,108,864 needs .* of position"):
        fit_context(EngineConfig(model=str(model_dir), max_model_len=2**26), cfg, 0, 4,
                    memory=memory)
    # asked for and fitting: served as asked, past the model's own (with a warning)
    assert fit_context(EngineConfig(model=str(model_dir), max_model_len=4096), cfg, 0, 4,
                       memory=memory) == 4096
    with pytest.raises(ModelFileError, match=r"weights take at least"):
        fit_context(EngineConfig(model=str(model_dir)), cfg, 0, 4, memory=1 << 10)


# -- the server ------------------------------------------------------------------------------
_PEAK_RSS = textwrap.dedent("""
    import resource, subprocess, sys
    done = subprocess.run(sys.argv[1:], capture_output=True, timeout=240)
    sys.stderr.write(done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace"))
    print(done.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
""")
RSS_BOUND_KB = 2_500_000  # the server's own start-up (torch, tokenizer) and nothing more


@pytest.mark.slow
@pytest.mark.integration
def test_server_refuses_a_million_layers_fast_without_allocating(model_dir: Path,
                                                                 tmp_path: Path) -> None:
    model = _with_config(model_dir, tmp_path / "m", num_hidden_layers=10**6)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS, sys.executable, "-m", "tidal", "serve", "--model",
         str(model), "--port", "0"], capture_output=True, timeout=300,
        cwd=ROOT)
    elapsed = time.monotonic() - started
    code, peak_kb = map(int, done.stdout.split())
    log = done.stderr.decode()
    assert code == 1, log
    assert "num_hidden_layers is 1,000,000; expected 1 to 4,096" in log and str(model) in log
    assert elapsed < 120, elapsed  # start-up included, on 2 busy cores
    assert peak_kb < RSS_BOUND_KB, peak_kb


@pytest.mark.slow
@pytest.mark.integration
def test_server_clamps_a_context_of_2_to_the_26(model_dir: Path, tmp_path: Path) -> None:
    """max_position_embeddings 2**26 with no --max-model-len: served, on a clamped context,
    with the server's peak RSS bounded (it passed 6 GB before)."""
    import httpx

    model = _with_config(model_dir, tmp_path / "m", max_position_embeddings=2**26)
    with running_server(model, "--kv-cache-memory", "8MiB", timeout=180) as srv:
        served = httpx.get(srv.url + "/get_server_info", timeout=30).json()["max_model_len"]
        assert served < 2**26
        status = Path(f"/proc/{srv.proc.pid}/status").read_text()
        peak_kb = int(next(line for line in status.splitlines()
                           if line.startswith("VmHWM:")).split()[1])
        assert peak_kb < RSS_BOUND_KB + 1_100_000, peak_kb  # at most 1 GiB of tables
        log = Path(srv.log.name).read_text(errors="replace")
        assert "serving a context of" in log
