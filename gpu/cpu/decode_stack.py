"""A float32 or bfloat16 Llama's decode steps in one C++ call on the CPU (``decoder.cpp``).

The Python model spends a good part of a decode step between its kernels (about 1.2 of 4.7 ms
at batch 1 on a 30M model), and holds the GIL there, so a server's event loop and the step take
turns. ``DecodeStack`` runs the same kernels in the same order from C++ with the GIL released,
giving bitwise the same hidden states. It takes steps whose every request has one query row;
prefill chunks and other dtypes keep the Python path. In bfloat16, whose linears run on oneDNN
(AMX here), it took the benchmark model's decode steps on a 2-core host from 5.4-5.6 to
4.1-4.3 ms at batch 1 and from 10.2-10.5 to 8.9-9.2 ms at batch 32 (``bench/profile_step.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from gpu.attention import AttentionMetadata
from gpu.attention.cpu_backend import CpuAttentionBackend
from gpu.cpu.kernels import load_cpu_kernels
from gpu.cpu.packed_linear import PLAIN_GEMM_MIN_ROWS, PackedLinear

# The dtypes the stack takes, each with whether its linears run on tidal's own GEMM (else on
# oneDNN, as PackedLinear packs them).
STACK_GEMMS = {torch.float32: True, torch.bfloat16: False}


def build_decode_stack(model: torch.nn.Module) -> Any | None:
    """The model's ``DecodeStack``, or ``None`` where it does not apply: no kernels, another
    dtype or device, another attention backend, q/k norms, or linears not packed (on the
    panel GEMM in float32, on oneDNN in bfloat16)."""
    kernels = load_cpu_kernels()
    cfg = model.config
    embedding = model.embed_tokens.weight
    if (kernels is None or embedding.device.type != "cpu" or embedding.dtype not in STACK_GEMMS
            or cfg.qk_norm or not kernels.decode_attention_supports(cfg.head_dim)):
        return None
    own_gemm = STACK_GEMMS[embedding.dtype]
    attns = [layer.self_attn for layer in model.layers]
    linears = [m for m in model.modules() if isinstance(m, (PackedLinear, torch.nn.Linear))]
    if (not all(isinstance(a.backend, CpuAttentionBackend) for a in attns)
            or not all(isinstance(m, PackedLinear) and m.own_gemm == own_gemm
                       for m in linears)):
        return None
    rotary = attns[0].rotary
    stack = kernels.DecodeStack(embedding, model.norm.weight, rotary.cos, rotary.sin,
                                cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
                                attns[0].scale)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        stack.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                        _spec(attn.qkv_proj), _spec(attn.o_proj), _spec(mlp.gate_up_proj),
                        _spec(mlp.down_proj))
    return stack


def runs_on_stack(input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
    """A decode-only step without padding rows, of fewer than ``PLAIN_GEMM_MIN_ROWS`` rows
    (from there, in layers without MKL's pack, the Python path's plain GEMM is faster)."""
    rows = input_ids.shape[0]
    return meta.is_decode_only and meta.num_actual_tokens == rows and rows < PLAIN_GEMM_MIN_ROWS


def _spec(linear: PackedLinear
          ) -> tuple[torch.Tensor, int, torch.Tensor | None, torch.Tensor | None, bool]:
    return (linear.packed_weight, linear.out_features, linear.bias, linear.mkl_packed_weight,
            not linear.own_gemm)
