"""A float32 or bfloat16 Llama's decode steps in one C++ call on the CPU (``csrc/decoder.cpp``).

The Python model spends a good part of a small model's decode step between its kernels, and
holds the GIL there, so a server's event loop and the step take turns. ``DecodeStack`` runs the
same kernels in the same order from C++ with the GIL released, its linears the model's own
``PlannedLinear``s, giving bitwise the same hidden states. It takes steps whose every request
has one query row and whose row count the ops' plans give to tidal's kernels; prefill chunks
and other dtypes keep the Python path. An int8 KV cache (``--kv-cache-dtype int8``) takes it
too: each layer's four cache tensors (values and scales) go to the same write and attention
kernels as from Python. A quantized tied head's int8 embedding (``gpu/quantization/head.py``)
gives the step a small table that each step's rows are dequantized into before the call.
Qwen3's per-head query and key norms run in the step as in the Python model. A mixture of
quantized experts (Qwen3-MoE, Mixtral) runs as the C++ block the Python model's ``MoE`` calls
(``gpu/quantization/experts.compile_blocks``); float experts keep the Python path.
"""

from __future__ import annotations

from typing import Any

import torch

from tidal.gpu.attention import AttentionMetadata
from tidal.gpu.attention.cpu_backend import CpuAttentionBackend
from tidal.gpu.cpu.kernels import load_cpu_kernels
from tidal.gpu.cpu.packed_linear import PackedLinear
from tidal.gpu.moe import MoE
from tidal.gpu.quantization.head import QuantEmbedding
from tidal.gpu.quantization.linear import QuantLinear

STACK_DTYPES = (torch.float32, torch.bfloat16)


def build_decode_stack(model: torch.nn.Module, max_rows: int = 256) -> Any | None:
    """The model's ``DecodeStack``, or ``None`` where it does not apply: no kernels, another
    dtype or device, another attention backend, a model whose layers are not
    Llama's (``one_call_decode``: Gemma's are not), experts without a C++ block (``MoE.block``:
    float ones), or linears without a C++ ``PlannedLinear`` (not packed; quantized ones have one
    where the kernels are built), or tensor parallelism (its all-reduces run between the
    layers' ops), or pipeline stages (the step runs the whole model). ``max_rows``: the most
    rows a step may have, which an int8 embedding's staged table holds."""
    kernels = load_cpu_kernels()
    if (model.tp.size > 1 or model.stage.size > 1
            or not getattr(model, "one_call_decode", False)):
        return None
    cfg = model.config
    table = model.embed_tokens
    quantized = isinstance(table, QuantEmbedding)
    embedding = table.weight_format.q if quantized else table.weight
    dtype = table.dtype if quantized else embedding.dtype
    if (kernels is None or embedding.device.type != "cpu" or dtype not in STACK_DTYPES
            or not kernels.decode_attention_supports(cfg.head_dim)
            or any(isinstance(layer.mlp, MoE) and layer.mlp.block is None
                   for layer in model.layers)):
        return None
    attns = [layer.self_attn for layer in model.layers]
    linears = [m for layer in model.layers for m in layer.modules()
               if isinstance(m, (PackedLinear, QuantLinear, torch.nn.Linear))]
    if (not all(isinstance(a.backend, CpuAttentionBackend) for a in attns)
            or not all(isinstance(m, (PackedLinear, QuantLinear)) and m.kernel is not None
                       for m in linears)):
        return None
    if quantized:
        embedding = table.stage_table(max_rows)
    rotary = attns[0].rotary
    stack = kernels.DecodeStack(embedding, model.norm.weight, rotary.cos, rotary.sin,
                                cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
                                attns[0].scale)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        q_norm, k_norm = ((attn.q_norm.weight, attn.k_norm.weight) if cfg.qk_norm
                          else (None, None))
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if isinstance(mlp, MoE):
            stack.add_moe_layer(*norms, attn.qkv_proj.kernel, attn.o_proj.kernel, mlp.block,
                                q_norm, k_norm)
        else:
            stack.add_layer(*norms, attn.qkv_proj.kernel, attn.o_proj.kernel,
                            mlp.gate_up_proj.kernel, mlp.down_proj.kernel, q_norm, k_norm)
    return stack


def runs_on_stack(input_ids: torch.Tensor, meta: AttentionMetadata,
                  stack_rows: list[bool]) -> bool:
    """A decode-only step without padding rows, whose row count the ops' plans give to the
    kernels (``stack_rows[rows]``; the last entry holds for more rows)."""
    rows = input_ids.shape[0]
    return stack_takes(rows, stack_rows) and meta.is_decode_only and meta.num_actual_tokens == rows


def stack_takes(rows: int, stack_rows: list[bool]) -> bool:
    """Whether the ops' plans give a step of ``rows`` rows to the kernels (``stack_rows[rows]``;
    the last entry holds for more rows, and no entries for every count)."""
    return stack_rows[min(rows, len(stack_rows) - 1)] if stack_rows else True
