"""Quantized models served on ``TIDAL_TEST_DEVICE`` give their CPU twins' greedy tokens.

``--quantization int8`` and ``int4`` on the embedded model, and a GGUF file of Q4_K blocks
(Q8_0 where a row is no multiple of 256) written here from it, each served by a real server in
float32 and asked through the official ``openai`` client, against the offline engine on the
CPU over the same weights (``bench/served_twins.py``: the twin runs torch's paths, and where the
two part, its two best tokens there must be a near tie). On a GPU that is the Triton GEMMs,
the int8 head and embedding on the device, CUDA graphs and async scheduling; on the CPU,
tidal's kernels.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file, save_file

from bench.served_twins import SERVED_PROMPTS, compare, served_completions, twin_completions
from tests.gguf_writing import write_gguf
from tests.live_server import running_server
from tidal.core.config import DEFAULT_MODEL

pytestmark = [pytest.mark.gpu, pytest.mark.integration, pytest.mark.slow]

TOKENS = 32


def _check_twins(model: str, *server_args: str, **twin_args: object) -> None:
    twins = twin_completions(SERVED_PROMPTS, TOKENS, model, **twin_args)
    # four requests at most: as few CUDA graphs to capture as that needs
    with running_server(Path(model), "--dtype", "float32", "--max-num-seqs", "4",
                        *server_args) as server:
        served = served_completions(server.url, SERVED_PROMPTS, TOKENS)
    for prompt, ours, twin in zip(SERVED_PROMPTS, served, twins):
        result = compare(prompt, ours, twin)
        assert result.agrees, (
            f"served {ours.text!r} left the CPU twin's {twin.text!r} at token "
            f"{result.tokens}, where the twin's best two are not a near tie")


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_quantized_model_serves_its_cpu_twins_tokens(quantization):
    _check_twins(DEFAULT_MODEL, "--quantization", quantization, quantization=quantization)


def _q4_k_gguf(out: Path) -> Path:
    """The embedded model as a GGUF file: its decoder linears in Q4_K where their rows take
    256-wide blocks, else Q8_0; the embedding in Q8_0."""
    source, float_dir = Path(DEFAULT_MODEL), out / "float32"
    float_dir.mkdir()
    for f in source.iterdir():
        if f.is_file() and f.suffix != ".safetensors":  # not the draft's folder
            (float_dir / f.name).write_bytes(f.read_bytes())
    weights = load_file(source / "model.safetensors")
    save_file({k: v.float().contiguous() for k, v in weights.items()},
              str(float_dir / "model.safetensors"))
    types = {"token_embd.weight": T.Q8_0}
    for name, w in weights.items():
        if w.ndim == 2 and ".layers." in name:
            block = gguf.GGML_QUANT_SIZES[T.Q4_K][0]
            layer, part = name.split(".")[2], name.split(".")[-2]
            gguf_part = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v",
                         "o_proj": "attn_output", "gate_proj": "ffn_gate", "up_proj": "ffn_up",
                         "down_proj": "ffn_down"}[part]
            types[f"blk.{layer}.{gguf_part}.weight"] = T.Q4_K if w.shape[1] % block == 0 else T.Q8_0
    path = out / "shakespeare-q4_k.gguf"
    write_gguf(float_dir, path, "llama", types)
    assert sum(t == T.Q4_K for t in types.values()) >= 6 * 6
    return path


def test_a_q4_k_gguf_file_serves_its_cpu_twins_tokens(tmp_path):
    _check_twins(str(_q4_k_gguf(tmp_path)))
