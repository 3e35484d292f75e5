"""Gemma 2 and Gemma 3 (text) over the Llama model's parts (``gpu/models/llama.py``).

What differs from a Llama: layers alternate between sliding-window (local) and global attention,
with their own rotary bases in Gemma 3 (``ModelConfig.gemma``, read by ``gpu/gemma_config.py``);
the attention scale is ``query_pre_attn_scalar ** -0.5``; Gemma 2 soft-caps the attention
logits and the final logits (``cap * tanh(x / cap)``); the MLP's activation is GELU (tanh
approximation); every block is normed before and after (four norms a layer), each norm scaling
by ``1 + weight``; the embedding is scaled by ``sqrt(hidden_size)``; and Gemma 3 norms q and k
per head. Each layer hands its window and softcap to the attention backend with every call.
The sliding layers' KV blocks are a group of their own, holding each request's window only
(``core/kv_window.py``); a sliding layer attends over ``meta.windowed``.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from tidal.gpu.attention import AttentionBackend, AttentionMetadata
from tidal.gpu.layers import GeluAndMul, GemmaRMSNorm, RotaryEmbedding
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.models.llama import MLP, Attention, KVCache, LlamaForCausalLM


class GemmaAttention(Attention):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend,
                 window: int) -> None:
        super().__init__(cfg, rotary, backend)
        assert cfg.gemma is not None
        if cfg.qk_norm:  # Gemma 3
            self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.gemma.query_pre_attn_scalar ** -0.5
        self.window = window
        self.softcap = cfg.gemma.attn_softcap


class GemmaMLP(MLP):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.act_fn = GeluAndMul()


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend,
                 window: int) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = GemmaAttention(cfg, rotary, backend, window)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = GemmaMLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, delta: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """As Llama's ``DecoderLayer``: takes and returns the residual stream and the output
        still to be added to it, each add done by the norm after it."""
        if delta is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_and_norm(x, delta)
        attn = self.post_attention_layernorm(self.self_attn(positions, h, kv_cache, meta))
        x, h = self.pre_feedforward_layernorm.add_and_norm(x, attn)
        return x, self.post_feedforward_layernorm(self.mlp(h))


class GemmaForCausalLM(LlamaForCausalLM):
    """``Gemma2ForCausalLM`` and ``Gemma3ForCausalLM``."""

    one_call_decode = False  # the C++ decode step runs Llama's layers only
    norm_type = GemmaRMSNorm

    def build_layers(self, cfg: ModelConfig, backend: AttentionBackend) -> list[nn.Module]:
        gemma = cfg.gemma
        if gemma is None:
            raise ValueError(f"{cfg.architecture} config lacks its Gemma facts")
        global_rotary = RotaryEmbedding(cfg.head_dim, self.max_positions, cfg.rope_theta,
                                        cfg.rope_scaling)
        local_rotary = RotaryEmbedding(cfg.head_dim, self.max_positions, gemma.local_rope_theta,
                                       gemma.local_rope_scaling)
        return [GemmaDecoderLayer(cfg, local_rotary if window else global_rotary, backend,
                                  window)
                for window in gemma.layer_windows]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding scaled by ``sqrt(hidden_size)`` rounded to its dtype, as HF's."""
        x = self.embed_tokens(input_ids)
        return x * _rounded(math.sqrt(self.config.hidden_size), x.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.gemma.final_softcap if self.config.gemma else 0.0
        return torch.tanh(logits / cap) * cap if cap else logits


@functools.cache
def _rounded(value: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(value, dtype=dtype))
