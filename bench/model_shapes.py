"""Random-weight model directories in the shapes of real models, for GPU benchmarks, and of
the CPU serving comparison's small Llama (``llama-28m``).

Weights are drawn straight into the checkpoint's dtype (no float32 model in between), so a
1B-parameter directory takes seconds. The tokenizer is the random-model byte-level BPE padded
to the model's vocabulary, so every id the model can sample decodes. ``tiny=True`` keeps the
architecture and shrinks every size, for CPU smoke runs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from tidal.gpu.random_model import build_tokenizer

SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": dict(
        model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
        tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=32768,
        rms_norm_eps=1e-6),
    "llama-3.2-1b": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}
# Shapes for the CPU benchmarks, not in the GPU benchmarks' default sweep.
BENCH_SHAPES: dict[str, dict] = {
    # Quantized serving's memory bar: a 3B model in int4 on a CPU.
    "qwen2.5-3b": dict(
        model_type="qwen2", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
        tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=32768,
        rms_norm_eps=1e-6),
    # A model a user would recognise on a CPU: Qwen2.5-0.5B's body (hidden 896, 24 layers,
    # 14 query and 2 KV heads) as a Llama with a 32,000-token vocabulary (0.42B parameters,
    # 1.66 GB in float32), so llama.cpp converts it as it does any Llama.
    "llama-0.4b": dict(
        model_type="llama", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, vocab_size=32000,
        tie_word_embeddings=False, rope_theta=1000000.0, max_position_embeddings=4096,
        rms_norm_eps=1e-6),
    # The CPU serving comparison's small Llama against vLLM and llama.cpp (27.7M parameters):
    # the default benchmark model's layers (bench.common.BENCH_LLAMA) with a 4,000-token vocab.
    # The embeddings throughput target's model (bench/embeddings_throughput.py): Qwen3-0.6B's
    # shape, the body of Qwen3-Embedding-0.6B and Qwen3-Reranker-0.6B
    "qwen3-0.6b": dict(
        model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=40960,
        rms_norm_eps=1e-6),
    "llama-28m": dict(
        model_type="llama", hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, vocab_size=4000,
        tie_word_embeddings=False, max_position_embeddings=4096),
    # The MoE serving target (issue 51): Qwen3-30B-A3B's own config (hidden 2048, 128 experts
    # of width 768, 8 a token, renormalised; 32 query and 4 KV heads of 128; untied head over
    # 151,936 tokens) with 4 of its 48 layers. All 48 are 30.5B parameters, 61 GB in bfloat16;
    # 4 are 3.1B (6.2 GB in bfloat16, 12.4 GB as llama.cpp's f32 GGUF on disk), so the
    # directory, the GGUFs and both servers (2-3.5 GB each in 4 bits) fit a 24 GiB host.
    # A decode step still reads a real layer's 8 experts of 128 and the real head.
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=4,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        tie_word_embeddings=False, rope_theta=1000000.0, max_position_embeddings=40960,
        rms_norm_eps=1e-6),
}
# gpt-oss-20b's own config (hidden 2880, 32 experts of width 2880, 4 a token, softmax after
# the top-k; 64 query and 8 KV heads of 64, sliding and full layers alternating, sinks; untied
# head over 201,088 tokens) with 4 of its 24 layers, its experts in MXFP4 as published
# (``MXFP4_SHAPES``): 4.5B parameters, 1.7 GB of experts and 2.5 GB of bfloat16 besides.
BENCH_SHAPES["gpt-oss-20b"] = dict(
    model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_local_experts=32,
    num_experts_per_tok=4, num_hidden_layers=4, num_attention_heads=64, num_key_value_heads=8,
    head_dim=64, vocab_size=201088, sliding_window=128,
    layer_types=["sliding_attention", "full_attention"] * 2, attention_bias=True,
    swiglu_limit=7.0, tie_word_embeddings=False, rope_theta=150000.0,
    max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                  "original_max_position_embeddings": 4096, "truncate": False})
# Shapes whose experts are written as MXFP4 blocks and scales (``quant_method`` ``mxfp4``)
MXFP4_SHAPES = {"gpt-oss-20b"}
_MXFP4_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
SHARD_BYTES = 1 << 30  # a checkpoint shard's size, as hub checkpoints split them
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=1024)
# and a MoE shape's experts: still several, a token still choosing more than one
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


ALL_SHAPES: dict[str, dict] = SHAPES | BENCH_SHAPES


def shape_settings(name: str, tiny: bool = False) -> dict:
    if name not in ALL_SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(ALL_SHAPES)}")
    settings = dict(ALL_SHAPES[name])
    if tiny:
        settings.update(TINY)
        if "num_experts" in settings:
            settings.update(TINY_MOE)
    return settings


def build_shaped_model_dir(path: str | Path, name: str, tiny: bool = False,
                           dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                           **overrides: object) -> Path:
    """A model directory of shape ``name`` under ``path`` (reused if already built), its
    config's settings changed where ``overrides`` say (fewer layers, for a smoke run)."""
    path = Path(path)
    if all((path / f).is_file() for f in ("config.json", "tokenizer.json")):  # written last
        return path
    path.mkdir(parents=True, exist_ok=True)
    settings = shape_settings(name, tiny) | overrides
    tokenizer = build_tokenizer(settings["vocab_size"])
    settings["vocab_size"] = max(settings["vocab_size"], len(tokenizer))
    model_type = settings.pop("model_type")
    config = AutoConfig.for_model(model_type, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, **settings)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = {name: p.shape for name, p in skeleton.state_dict().items()
              if not (config.tie_word_embeddings and name == "lm_head.weight")}
    if name in MXFP4_SHAPES:
        shapes = mxfp4_expert_shapes(shapes)
        config.quantization_config = {"quant_method": "mxfp4",
                                      "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                 "model.layers.*.mlp.router",
                                                                 "model.embed_tokens", "lm_head"]}
    _save_shards(path, shapes, lambda n, s: _random_weight(n, s, dtype, device, gen))
    config.architectures = [type(skeleton).__name__]
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _save_shards(path: Path, shapes: dict[str, torch.Size],
                 make: Callable[[str, torch.Size], torch.Tensor]) -> None:
    """The weights in safetensors shards of at most ``SHARD_BYTES`` (one file if they fit),
    each made only when its shard is written, so a large model never sits whole in memory."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * 2
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    if len(shards) == 1:
        save_file({n: make(n, shapes[n]) for n in shards[0]}, str(path / "model.safetensors"),
                  metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: make(n, shapes[n]) for n in names}, str(path / file),
                  metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
        total += sum(math.prod(shapes[n]) for n in names)
    # the index as transformers writes it (its loader reads the metadata too)
    index = {"metadata": {"total_size": total * 2}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def mxfp4_expert_shapes(shapes: dict[str, torch.Size]) -> dict[str, torch.Size]:
    """The stacked experts (HF's ``[E, in, out]``) as MXFP4's ``_blocks`` ``[E, out, in / 32,
    16]`` and ``_scales`` ``[E, out, in / 32]``."""
    out: dict[str, torch.Size] = {}
    for name, shape in shapes.items():
        if not _MXFP4_EXPERTS.search(name):
            out[name] = shape
            continue
        experts, inputs, outputs = shape
        out[name + "_blocks"] = torch.Size((experts, outputs, inputs // 32, 16))
        out[name + "_scales"] = torch.Size((experts, outputs, inputs // 32))
    return out


def _random_weight(name: str, shape: torch.Size, dtype: torch.dtype, device: str,
                   gen: torch.Generator) -> torch.Tensor:
    if name.endswith("_blocks"):  # MXFP4 codes, any of the 16
        return torch.randint(0, 256, shape, generator=gen, device=device,
                             dtype=torch.uint8).cpu()
    if name.endswith("_scales"):  # scales 2^-9 .. 2^-6: values of about 0.02, as above
        return torch.randint(118, 122, shape, generator=gen, device=device,
                             dtype=torch.uint8).cpu()
    if "norm" in name:
        return torch.ones(shape, dtype=dtype)
    t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    return (t * (0.02 if len(shape) > 1 else 0.01)).to(dtype).cpu()


def weight_bytes(model) -> int:
    """Bytes of weights a decode step reads: every parameter once (a tied embedding once, as
    the output head; the embedding lookup itself reads a few rows only), and each quantized
    linear's weight in its layouts (``quantized_bytes``)."""
    from tidal.gpu.quantization.linear import QuantLinear

    seen: set[int] = set()
    total = 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.data_ptr() in seen or name.endswith("embed_tokens.weight"):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total + sum(quantized_bytes(m) for m in model.modules() if isinstance(m, QuantLinear))


def quantized_bytes(layer) -> int:
    """A ``QuantLinear``'s weight bytes: its own form's (4-bit values two to a byte) before it
    is packed, else every tensor of the layouts its plan kept (on a GPU, the Triton method's
    one)."""
    if layer.weight_format is not None:
        return layer.weight_format.nbytes

    def tensors(v: object) -> list[torch.Tensor]:
        if isinstance(v, torch.Tensor):
            return [v]
        if isinstance(v, (tuple, list)):
            return [t for x in v for t in tensors(x)]
        if dataclasses.is_dataclass(v):
            return [t for f in dataclasses.fields(v) for t in tensors(getattr(v, f.name))]
        return []

    layouts = [v for k, v in vars(layer.packs).items() if k not in ("format", "kernels")]
    return sum(t.numel() * t.element_size() for t in tensors(layouts))
