"""GPTQ, AWQ and compressed-tensors checkpoints, quantized and packed here by reference code
written from each format's description (plain loops and shifts, no downloads, nothing shared
with the readers): the readers give back exactly the quantized values, and tidal's greedy
tokens and logprobs equal HF transformers' on the float model with those values dequantized
into it."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tests.device import TEST_DEVICE
from tests.hf_reference import check_against_hf, fidelity_llm, reference_prompts
from tidal.gpu.checkpoints import checkpoint_weights
from tidal.gpu.quantization.linear import QuantLinear
from tidal.gpu.quantization.weights import QuantizedWeight
from tidal.gpu.random_model import build_model_dir

pytestmark = pytest.mark.gpu

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ARCHS = {"llama": ("llama", {}), "qwen2": ("qwen2", {"hidden_size": 128})}  # qwen2: biases


# ---- the reference quantizer: codes, zeros and scales per group of consecutive inputs ----

@dataclass
class RefQuant:
    """One linear quantized by the test: ``W = (q - zeros) * scales`` per group."""

    bits: int
    q: np.ndarray  # [out, in], unsigned codes
    zeros: np.ndarray  # [out, groups], unsigned codes
    scales: torch.Tensor  # [out, groups], float16 or bfloat16, as the formats store them

    def dequantize(self) -> torch.Tensor:
        group = self.q.shape[1] // self.zeros.shape[1]
        codes = torch.from_numpy(self.q - np.repeat(self.zeros, group, axis=1)).float()
        return codes * self.scales.float().repeat_interleave(group, dim=1)


def quantize_ref(w: torch.Tensor, bits: int, group: int, symmetric: bool,
                 scale_dtype: torch.dtype = torch.float16) -> RefQuant:
    maxq = 2 ** bits - 1
    out, inp = w.shape
    g = w.detach().float().view(out, inp // group, group)
    if symmetric:
        scales = (g.abs().amax(-1) * 2 / maxq).to(scale_dtype)
        zeros = torch.full(scales.shape, (maxq + 1) // 2)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scales = ((hi - lo) / maxq).to(scale_dtype)
        zeros = torch.round(-lo / scales.float()).clamp(0, maxq).long()
    q = torch.round(g / scales.float()[..., None]) + zeros[..., None]
    q = q.clamp(0, maxq).long().view(out, inp)
    return RefQuant(bits, q.numpy(), zeros.numpy(), scales)


# ---- the reference packers, one per format, as each format's documentation describes ----

def _int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


def pack_gptq(ref: RefQuant, v1: bool) -> dict[str, torch.Tensor]:
    """AutoGPTQ: qweight [in/p, out] (input row*p + j at bits j*b), qzeros [groups, out/p]
    (output col*p + j at bits j*b), v1 storing each zero minus one."""
    b, per = ref.bits, 32 // ref.bits
    weight, zeros = ref.q.T.astype(np.uint64), (ref.zeros - (1 if v1 else 0)).T.astype(np.uint64)
    qweight = np.zeros((weight.shape[0] // per, weight.shape[1]), dtype=np.uint64)
    for row in range(qweight.shape[0]):
        for j in range(per):
            qweight[row] |= weight[row * per + j] << np.uint64(b * j)
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // per), dtype=np.uint64)
    for col in range(qzeros.shape[1]):
        for j in range(per):
            qzeros[:, col] |= zeros[:, col * per + j] << np.uint64(b * j)
    inputs, groups = ref.q.shape[1], ref.zeros.shape[1]
    g_idx = torch.tensor([k // (inputs // groups) for k in range(inputs)], dtype=torch.int32)
    return {"qweight": _int32(qweight), "qzeros": _int32(qzeros),
            "scales": ref.scales.t().contiguous(), "g_idx": g_idx}


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack_awq(ref: RefQuant) -> dict[str, torch.Tensor]:
    """AutoAWQ gemm: qweight [in, out/8] and qzeros [groups, out/8], the i-th nibble of word
    col holding output col*8 + AWQ_ORDER[i]."""
    def pack(values: np.ndarray) -> torch.Tensor:
        words = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.uint64)
        for col in range(words.shape[1]):
            for i in range(8):
                words[:, col] |= values[:, col * 8 + AWQ_ORDER[i]].astype(np.uint64) << \
                    np.uint64(4 * i)
        return _int32(words)
    return {"qweight": pack(ref.q.T), "qzeros": pack(ref.zeros.T),
            "scales": ref.scales.t().contiguous()}


def pack_compressed(ref: RefQuant, symmetric: bool) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized: signed values plus 2**(b-1), value k of a row in
    word k // p at bits (k % p) * b; asymmetric zero points packed the same way along the
    outputs."""
    b, per, middle = ref.bits, 32 // ref.bits, 2 ** (ref.bits - 1)

    def pack_rows(signed: np.ndarray) -> np.ndarray:
        stored = (signed + middle).astype(np.uint64)
        words = np.zeros((stored.shape[0], stored.shape[1] // per), dtype=np.uint64)
        for k in range(stored.shape[1]):
            words[:, k // per] |= stored[:, k] << np.uint64((k % per) * b)
        return words
    out = {"weight_packed": _int32(pack_rows(ref.q - middle)),
           "weight_scale": ref.scales.contiguous(),
           "weight_shape": torch.tensor(ref.q.shape, dtype=torch.int64)}
    if not symmetric:
        out["weight_zero_point"] = _int32(pack_rows((ref.zeros - middle).T).T)
    return out


def pack_int8(ref: RefQuant) -> dict[str, torch.Tensor]:
    """compressed-tensors int-quantized: the signed int8 weight and its scale."""
    return {"weight": torch.from_numpy((ref.q - 128).astype(np.int8)),
            "weight_scale": ref.scales.contiguous()}


# ---- the formats under test ----

def _ct_config(fmt: str, bits: int, group: int | None, symmetric: bool) -> dict:
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "dynamic": False,
               "strategy": "group" if group else "channel", "group_size": group,
               "actorder": None}
    return {"quant_method": "compressed-tensors", "format": fmt,
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None, "format": fmt}}}


@dataclass
class Format:
    arch: str
    bits: int
    group: int | None  # None: one group per row
    symmetric: bool
    pack: object  # RefQuant -> {suffix: tensor}
    config: dict
    scale_dtype: torch.dtype = torch.float16
    quantize_head: bool = False
    checks: dict = field(default_factory=dict)


def _gptq(bits: int, group: int, sym: bool, fmt: str) -> dict:
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": False,
            "sym": sym, "checkpoint_format": fmt}


FORMATS = {
    "gptq-v1-int4-g32": Format("llama", 4, 32, True, lambda r: pack_gptq(r, v1=True),
                               _gptq(4, 32, True, "gptq"), quantize_head=True),
    "gptq-v2-int4-g64-asym": Format("qwen2", 4, 64, False, lambda r: pack_gptq(r, v1=False),
                                    _gptq(4, 64, False, "gptq_v2")),
    "gptq-v1-int8-channel": Format("llama", 8, None, True, lambda r: pack_gptq(r, v1=True),
                                   _gptq(8, -1, True, "gptq")),
    "awq-g32": Format("llama", 4, 32, False, pack_awq,
                      {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                       "version": "gemm", "modules_to_not_convert": None}),
    "awq-g64-qwen2": Format("qwen2", 4, 64, False, pack_awq,
                            {"quant_method": "awq", "bits": 4, "group_size": 64,
                             "zero_point": True, "version": "gemm"}),
    "ct-w4a16-g32": Format("llama", 4, 32, True, lambda r: pack_compressed(r, True),
                           _ct_config("pack-quantized", 4, 32, True), torch.bfloat16),
    "ct-w4a16-g64-asym": Format("qwen2", 4, 64, False, lambda r: pack_compressed(r, False),
                                _ct_config("pack-quantized", 4, 64, False), torch.bfloat16),
    "ct-w8-channel": Format("llama", 8, None, True, pack_int8,
                            _ct_config("int-quantized", 8, None, True), torch.bfloat16),
}


@dataclass
class Built:
    path: Path
    hf: AutoModelForCausalLM
    refs: dict[str, RefQuant]


def build_checkpoint(tmp: Path, fmt: Format) -> Built:
    """A random model saved in ``fmt``, and its HF twin holding the dequantized weights."""
    arch, overrides = ARCHS[fmt.arch]
    src = build_model_dir(tmp / "float", arch, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    dst = tmp / "quantized"
    shutil.copytree(src, dst)
    tensors, refs = {}, {}
    for name, tensor in hf.state_dict().items():
        module, _, leaf = name.rpartition(".")
        quantized = module.rpartition(".")[2] in LINEARS or (fmt.quantize_head
                                                            and module == "lm_head")
        if leaf != "weight" or not quantized:
            tensors[name] = tensor.clone().contiguous()
            continue
        ref = quantize_ref(tensor, fmt.bits, fmt.group or tensor.shape[1], fmt.symmetric,
                           fmt.scale_dtype)
        refs[module] = ref
        tensors.update({f"{module}.{k}": v for k, v in fmt.pack(ref).items()})
        with torch.no_grad():
            hf.get_parameter(name).copy_(ref.dequantize())
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = fmt.config
    (dst / "config.json").write_text(json.dumps(config))
    hf.generation_config.eos_token_id = None  # run on past EOS, as ignore_eos does
    return Built(dst, hf.to(TEST_DEVICE), refs)


_BUILT: dict[str, Built] = {}


@pytest.fixture(params=sorted(FORMATS))
def built(request, tmp_path_factory) -> Built:
    if request.param not in _BUILT:
        _BUILT[request.param] = build_checkpoint(tmp_path_factory.mktemp(request.param),
                                                 FORMATS[request.param])
    return _BUILT[request.param]


# ---- the tests ----

def test_readers_give_back_exactly_the_quantized_values(built):
    weights = dict(checkpoint_weights(built.path))
    for module, ref in built.refs.items():
        value = weights[f"{module}.weight"]
        if module == "lm_head":  # not a decoder linear: the loader wants it in float
            assert isinstance(value, torch.Tensor)
            assert torch.equal(value, ref.dequantize())
            continue
        assert isinstance(value, QuantizedWeight), module
        assert value.bits == ref.bits and value.shape == ref.q.shape
        assert value.group_size == ref.q.shape[1] // ref.zeros.shape[1]
        assert torch.equal(value.dequantize(), ref.dequantize()), module
    float_names = {n for n, v in weights.items() if isinstance(v, torch.Tensor)}
    state = built.hf.state_dict()
    for name in float_names - {f"{m}.weight" for m in built.refs}:
        assert torch.equal(weights[name], state[name].cpu()), name


@pytest.mark.slow
def test_tokens_and_logprobs_match_hf_on_the_dequantized_model(built):
    llm = fidelity_llm(str(built.path))
    model = llm.engine.executor.runner.model
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 4 * 2  # qkv, o, gate_up, down in each of the two layers
    built.hf.generation_config.eos_token_id = None  # run on past EOS, as ignore_eos does
    built.hf.reference_cache = {}
    check_against_hf(built.hf, llm, reference_prompts(0)[:4])


def test_a_linear_split_across_shards_reads_the_same(tmp_path, built):
    """The parts of one linear may lie in different shards of an indexed checkpoint."""
    shards = tmp_path / "sharded"
    shutil.copytree(built.path, shards)
    (shards / "model.safetensors").unlink()
    weight_map = {}
    tensors = load_file(str(built.path / "model.safetensors"))
    for i, name in enumerate(sorted(tensors)):
        weight_map[name] = f"model-0000{i % 2 + 1}-of-00002.safetensors"
    for file in set(weight_map.values()):
        save_file({n: t for n, t in tensors.items() if weight_map[n] == file}, str(shards / file))
    (shards / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    whole, split = dict(checkpoint_weights(built.path)), dict(checkpoint_weights(shards))
    assert sorted(whole) == sorted(split)
    for name, value in whole.items():
        if isinstance(value, QuantizedWeight):
            assert torch.equal(split[name].dequantize(), value.dequantize()), name


def _checkpoint(tmp: Path, quantization: dict, tensors: dict[str, torch.Tensor]) -> Path:
    (tmp / "config.json").write_text(json.dumps({"model_type": "llama",
                                                  "quantization_config": quantization}))
    save_file(tensors or {"model.norm.weight": torch.ones(4)}, str(tmp / "model.safetensors"))
    return tmp


def _ct_weights(**changes: object) -> dict:
    config = _ct_config("pack-quantized", 4, 32, True)
    config["config_groups"]["group_0"]["weights"].update(changes)
    return config


REFUSED = {
    "gptq-3-bit": (_gptq(3, 32, True, "gptq"), "3 bits"),
    "gptq-marlin": (_gptq(4, 32, True, "marlin"), "checkpoint_format 'marlin'"),
    "gptq-dynamic": ({**_gptq(4, 32, True, "gptq"), "dynamic": {"+:.*down": {"bits": 8}}},
                     "dynamic"),
    "awq-gemv": ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"},
                 "version 'gemv'"),
    "awq-8-bit": ({"quant_method": "awq", "bits": 8, "group_size": 32, "version": "gemm"},
                  "8 bits"),
    "bitsandbytes": ({"quant_method": "bitsandbytes"}, "'bitsandbytes' quantized checkpoint"),
    "ct-fp8": (_ct_weights(type="float", num_bits=8), "float weights"),
    "ct-2-bit": (_ct_weights(num_bits=2), "2 bits"),
    "ct-sparse": ({**_ct_config("pack-quantized", 4, 32, True),
                   "sparsity_config": {"format": "sparse-24-bitmask"}}, "sparse"),
    "ct-marlin-24": (_ct_config("marlin-24", 4, 32, True), "format 'marlin-24'"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_formats_not_read_are_refused_by_name(tmp_path, case):
    quantization, message = REFUSED[case]
    with pytest.raises(ValueError, match=message):
        checkpoint_weights(_checkpoint(tmp_path, quantization, {}))


def _gptq_linear(module: str, g_idx: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    parts = pack_gptq(quantize_ref(w, 4, 32, True), v1=True)
    if g_idx is not None:
        parts["g_idx"] = g_idx
    return {f"{module}.{k}": v for k, v in parts.items()}


def test_gptq_act_order_is_refused_unless_its_groups_are_in_order(tmp_path):
    module = "model.layers.0.mlp.up_proj"
    in_order = _checkpoint(tmp_path, {**_gptq(4, 32, True, "gptq"), "desc_act": True},
                           _gptq_linear(module))
    assert isinstance(dict(checkpoint_weights(in_order))[f"{module}.weight"], QuantizedWeight)
    shuffled = torch.arange(64, dtype=torch.int32) % 2  # inputs dealt to the groups in turn
    _checkpoint(tmp_path, {**_gptq(4, 32, True, "gptq"), "desc_act": True},
                _gptq_linear(module, shuffled))
    with pytest.raises(ValueError, match="desc_act"):
        dict(checkpoint_weights(tmp_path))


def test_compressed_tensors_group_act_order_is_refused(tmp_path):
    module = "model.layers.0.mlp.up_proj"
    ref = quantize_ref(torch.randn(16, 64), 4, 32, True, torch.bfloat16)
    tensors = {f"{module}.{k}": v for k, v in pack_compressed(ref, True).items()}
    tensors[f"{module}.weight_g_idx"] = torch.arange(64, dtype=torch.int32) % 2
    _checkpoint(tmp_path, _ct_weights(actorder="group"), tensors)
    with pytest.raises(ValueError, match="actorder"):
        dict(checkpoint_weights(tmp_path))


def test_compressed_tensors_groups_are_matched_by_name_pattern_before_class(tmp_path):
    """A down_proj in 8 bits (``re:`` target) beside 4-bit linears (``Linear`` target)."""
    gen = torch.Generator().manual_seed(1)
    refs = {"model.layers.0.mlp.up_proj": quantize_ref(torch.randn(16, 64, generator=gen), 4,
                                                       32, False, torch.bfloat16),
            "model.layers.0.mlp.down_proj": quantize_ref(torch.randn(16, 64, generator=gen),
                                                         8, 32, True, torch.bfloat16)}
    tensors = {f"{m}.{k}": v for m, ref in refs.items()
               for k, v in pack_compressed(ref, ref.bits == 8).items()}
    config = _ct_config("pack-quantized", 4, 32, False)
    eight = _ct_config("pack-quantized", 8, 32, True)["config_groups"]["group_0"]
    config["config_groups"]["group_1"] = {**eight, "targets": ["re:.*down_proj$"]}
    weights = dict(checkpoint_weights(_checkpoint(tmp_path, config, tensors)))
    for module, ref in refs.items():
        value = weights[f"{module}.weight"]
        assert value.bits == ref.bits
        assert torch.equal(value.dequantize(), ref.dequantize()), module


def test_compressed_tensors_int8_per_tensor_with_a_zero_point(tmp_path):
    module = "model.layers.0.self_attn.o_proj"
    q = torch.randint(-128, 128, (16, 64), dtype=torch.int8)
    scale, zero = torch.tensor([0.03], dtype=torch.bfloat16), torch.tensor([3], dtype=torch.int8)
    config = _ct_config("int-quantized", 8, None, False)
    config["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    tensors = {f"{module}.weight": q, f"{module}.weight_scale": scale,
               f"{module}.weight_zero_point": zero}
    value = dict(checkpoint_weights(_checkpoint(tmp_path, config, tensors)))[f"{module}.weight"]
    assert value.per_channel and value.q.dtype == torch.int8
    assert torch.equal(value.dequantize(), (q.float() - 3) * scale.float())
