"""MXFP4 checkpoints (gpt-oss's experts): the dequantizer against a decoder written here from the
OCP Microscaling spec, and the loader on a checkpoint whose blocks and scales this test writes
from known values: its experts kept in MXFP4, equal to the values written, held to HF
transformers running the same values in float, and on the dot kernel (which reads MXFP4 as it
is) within its rounding of the activations."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.hf_reference import check_against_hf, fidelity_llm, reference_prompts
from tests.unit.gpu.test_gpt_oss_fidelity import hf_model
from tidal.gpu.attention import get_attention_backend
from tidal.gpu.checkpoints.mxfp4 import dequantize_mxfp4
from tidal.gpu.cpu.kernels import load_cpu_kernels
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.model_loader import LoadOptions, load_model
from tidal.gpu.moe import MoE, route
from tidal.gpu.quantization.experts import QuantExperts
from tidal.gpu.quantization.linear import DOT, round_activations
from tidal.gpu.random_model import build_model_dir

pytestmark = pytest.mark.gpu


def spec_e2m1(nibble: int) -> float:
    """An FP4 E2M1 value by the OCP MX spec: sign bit 3, exponent bits 2-1 (bias 1), mantissa
    bit 0; exponent 0 is subnormal (0.m * 2^0)."""
    sign = -1.0 if nibble & 0b1000 else 1.0
    exponent, mantissa = (nibble >> 1) & 0b11, nibble & 1
    if exponent == 0:
        return sign * mantissa * 0.5
    return sign * 2.0 ** (exponent - 1) * (1 + mantissa / 2)


def spec_dequantize(nibbles: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``nibbles`` ``[..., G, 32]`` (one E2M1 code each) times their block's E8M0 scale
    ``2^(s - 127)``, element by element, as ``[..., G * 32]`` float64."""
    out = torch.empty(nibbles.shape, dtype=torch.float64)
    flat_out, flat_nib = out.view(-1, 32), nibbles.reshape(-1, 32)
    for block, scale in enumerate(scales.reshape(-1).tolist()):
        for i, code in enumerate(flat_nib[block].tolist()):
            flat_out[block, i] = spec_e2m1(code) * 2.0 ** (scale - 127)
    return out.flatten(-2)


def pack(nibbles: torch.Tensor) -> torch.Tensor:
    """``[..., G, 32]`` codes as ``[..., G, 16]`` bytes, element 2j in the low nibble."""
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).to(torch.uint8)


def random_codes(shape: tuple[int, ...], seed: int, scale_range: tuple[int, int]):
    gen = torch.Generator().manual_seed(seed)
    nibbles = torch.randint(0, 16, (*shape, 32), generator=gen, dtype=torch.uint8)
    scales = torch.randint(*scale_range, shape, generator=gen, dtype=torch.uint8)
    return nibbles, scales


def test_dequantizer_matches_the_spec():
    """Every code, scales far below and above one, in both dtypes."""
    nibbles, scales = random_codes((3, 4, 2), seed=0, scale_range=(100, 160))
    nibbles.view(-1)[:16] = torch.arange(16, dtype=torch.uint8)  # each code at least once
    want = spec_dequantize(nibbles, scales)
    for dtype in (torch.float32, torch.bfloat16):
        got = dequantize_mxfp4(pack(nibbles), scales, dtype)
        assert got.dtype == dtype and got.shape == want.shape
        assert torch.equal(got.double(), want)  # exact: each value fits in bfloat16


def test_dequantizer_refuses_mismatched_scales():
    nibbles, scales = random_codes((2, 3), seed=1, scale_range=(120, 130))
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(pack(nibbles), scales[:, :2])


def _write_mxfp4_twins(float_dir: Path, mxfp4_dir: Path) -> dict[str, torch.Tensor]:
    """Replace every expert matrix of the float checkpoint in ``float_dir`` by known MXFP4
    values: there in float (HF's ``[E, in, out]``), in ``mxfp4_dir`` as blocks and scales of
    ``[E, out, in]``. Returns each matrix by name, ``[E, out, in]``."""
    shutil.copytree(float_dir, mxfp4_dir)
    tensors = load_file(float_dir / "model.safetensors")
    quantized, matrices = dict(tensors), {}
    for i, name in enumerate(sorted(n for n in tensors if n.endswith(("gate_up_proj",
                                                                        "down_proj")))):
        e, inputs, outputs = tensors[name].shape
        nibbles, scales = random_codes((e, outputs, inputs // 32), seed=i,
                                       scale_range=(122, 126))
        matrix = spec_dequantize(nibbles, scales).float()  # [E, out, in]
        matrices[name] = matrix
        tensors[name] = matrix.transpose(1, 2).contiguous()
        del quantized[name]
        quantized[name + "_blocks"], quantized[name + "_scales"] = pack(nibbles), scales
    save_file(tensors, float_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(quantized, mxfp4_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((mxfp4_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (mxfp4_dir / "config.json").write_text(json.dumps(config))
    return matrices


def _held(linears, device: torch.device) -> torch.Tensor:
    """Experts' ``QuantLinear`` layers as the float ``[E, out, in]`` they multiply by (each
    layer over the identity, exact on the float paths whatever layout its plan kept)."""
    with torch.no_grad():
        return torch.stack([layer(torch.eye(layer.in_features, device=device)).T.cpu()
                            for layer in linears])


def test_loader_reads_hand_written_mxfp4_experts(tmp_path):
    """Experts of 64 inputs (two blocks a row) and of 32, kept in MXFP4 (or as the int8
    weights they equal, where no dot kernel reads them: here, with the kernels off, and on a
    GPU); the loader's layout against the written values, and the model's tokens against
    HF's on their float twin."""
    float_dir = build_model_dir(tmp_path / "float", "gpt_oss", num_hidden_layers=2)
    matrices = _write_mxfp4_twins(float_dir, tmp_path / "mxfp4")
    llm = fidelity_llm(str(tmp_path / "mxfp4"), cpu_kernels="off")  # the exact path, torch's
    experts = llm.engine.executor.runner.model.layers[1].mlp.experts
    assert isinstance(experts, QuantExperts)
    gate_up = matrices["model.layers.1.mlp.experts.gate_up_proj"]
    want = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)  # gate rows, then up rows
    device = experts.gate_up_proj_bias.device
    assert torch.equal(_held(experts.gate_up_proj, device), want)
    assert torch.equal(_held(experts.down_proj, device),
                       matrices["model.layers.1.mlp.experts.down_proj"])
    check_against_hf(hf_model(str(float_dir)), llm, reference_prompts(1)[2:4])


@pytest.mark.skipif(load_cpu_kernels() is None or load_cpu_kernels().dot_linear_tile()[0] == 0,
                    reason="needs the C++ kernels' dot kernel (x86 with AVX2)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_experts_on_the_dot_kernel(tmp_path, dtype):
    """A CPU load keeps the experts in MXFP4 (no int8 copy, no float one) and packs them for
    the dot kernel: each block's output is the token loop's over the written values with each
    projection's input rounded as the kernel rounds it, and its C++ form bit for bit its
    Python grouped path."""
    float_dir = build_model_dir(tmp_path / "float", "gpt_oss", num_hidden_layers=2,
                                hidden_size=128, head_dim=32)
    matrices = _write_mxfp4_twins(float_dir, tmp_path / "mxfp4")
    path = tmp_path / "mxfp4"
    options = LoadOptions(get_attention_backend("cpu", "cpu"), 128, dtype, "cpu")
    model = load_model(path, ModelConfig.from_dir(path), options).model
    g = torch.Generator().manual_seed(0)
    for i, moe in enumerate(model.layers[j].mlp for j in range(2)):
        linears = [*moe.experts.gate_up_proj, *moe.experts.down_proj]
        assert all(layer.codebook and layer.bits == 4 and layer.plan.single() == DOT
                   and layer.weight_format is None and layer.packs.dot[1].dtype == torch.uint8
                   for layer in linears)  # packed for the dot kernel only
        assert moe.block is not None
        gate_up = matrices[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        gate_up = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)
        down = matrices[f"model.layers.{i}.mlp.experts.down_proj"]
        for tokens in (1, 2, 9, 40):
            x = torch.randn(tokens, 128, generator=g).to(dtype)
            with torch.no_grad():
                want = _rounded_reference(moe, x, gate_up, down)
                compiled = moe(x)
                block, moe.block = moe.block, None
                python = moe(x)
                moe.block = block
            assert torch.equal(compiled, python)
            err = (python.float() - want).abs().max() / want.abs().max()
            assert err < (0.02 if dtype == torch.bfloat16 else 1e-5), (tokens, err)


def _rounded_reference(moe: MoE, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
                       ) -> torch.Tensor:
    """gpt-oss's block token by token in float32, each projection's input rounded to int8 per
    block of 32 (``round_activations``) as the dot kernel multiplies it; routed as the block
    routes ``x``."""
    weights, ids = route(moe.gate(x), moe.routing)
    x = x.float()
    gate_up_bias = moe.experts.gate_up_proj_bias.float()
    down_bias = moe.experts.down_proj_bias.float()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for weight, e in zip(weights[t], ids[t].tolist()):
            h = F.linear(round_activations(x[t:t + 1]), gate_up[e], gate_up_bias[e])
            y = F.linear(round_activations(moe.activation(h)), down[e], down_bias[e])
            out[t] += weight.float() * y[0]
    return out
