"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flattened token batch.

A step's tokens form one ``[num_tokens]`` batch without padding; attention goes through the
paged KV cache's backend; q/k/v and gate/up are fused at load time. A tensor-parallel rank builds
its ``local_config`` (``gpu/weight_shards.py``), a pipeline stage its layers (``gpu/pipeline.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from tidal.gpu.attention import AttentionBackend, AttentionMetadata
from tidal.gpu.distributed import TensorParallel, tensor_parallel
from tidal.gpu.layers import RMSNorm, RotaryEmbedding, SiluAndMul, VocabParallelEmbedding
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.pipeline import pipeline_stage, stage_inputs
from tidal.gpu.weight_shards import local_config

KVCache = tuple[torch.Tensor, ...]  # a layer's key and value caches (+ int8 scales: kv_quant)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding,
                 backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_heads, cfg.num_kv_heads,
                                                            cfg.head_dim)
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.backend = backend
        self.scale = cfg.head_dim ** -0.5
        self.window = 0  # a sliding window's length (gpu/models/gemma.py); 0: none
        self.softcap = 0.0  # soft-capping of the attention logits; 0: none
        self.sinks: nn.Parameter | None = None  # attention sinks, a logit a head (gpt-oss)
        self.tp = tensor_parallel()

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k, v = (t.view(-1, self.num_kv_heads, self.head_dim) for t in (k, v))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        meta = meta.windowed if self.window else meta  # the sliding layers' own blocks
        key_cache, value_cache, *scales = kv_cache
        self.backend.write_kv(k, v, key_cache, value_cache, meta.slot_mapping, *scales)
        out = self.backend.forward(q, key_cache, value_cache, meta, self.scale, *scales,
                                   window=self.window, softcap=self.softcap, sinks=self.sinks)
        return self.tp.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act_fn = SiluAndMul()
        self.tp = tensor_parallel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.act_fn(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    """Attention, then ``mlp``: the dense gated MLP, or a mixture of experts (``gpu/moe.py``)."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend,
                 mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def forward(self, positions: torch.Tensor, x: torch.Tensor, delta: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Takes the residual stream ``x`` and the previous layer's output ``delta`` still to
        be added to it (None for the first layer), and returns the same pair: each residual
        add is done by the norm that follows it, in one pass."""
        if delta is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_and_norm(x, delta)
        x, h = self.post_attention_layernorm.add_and_norm(
            x, self.self_attn(positions, h, kv_cache, meta))
        return x, self.mlp(h)


class LlamaForCausalLM(nn.Module):
    # Whether the CPU's one-call decode step (gpu/cpu/decode_stack.py) runs this model's layers.
    one_call_decode = True
    norm_type: type[RMSNorm] = RMSNorm

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend,
                 max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.tp: TensorParallel = tensor_parallel()
        self.local_config = local = local_config(cfg, self.tp)  # this rank's heads and MLP
        self.max_positions = max_positions
        self.stage = stage = pipeline_stage()  # which layers, and the embedding or head
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
                             if stage.holds_embedding(cfg) else None)
        self.layers = nn.ModuleList(self.build_layers(local, backend))
        self.norm = self.norm_type(cfg.hidden_size, cfg.rms_norm_eps) if stage.is_last else None
        self.lm_head = (nn.Linear(cfg.hidden_size, self.tp.shard_size(cfg.vocab_size), bias=False)
                        if stage.is_last else None)
        self.tie_weights()

    def build_layers(self, cfg: ModelConfig, backend: AttentionBackend) -> list[nn.Module]:
        """The decoder layers, over this rank's ``cfg``."""
        rotary = RotaryEmbedding(cfg.head_dim, self.max_positions, cfg.rope_theta,
                                 cfg.rope_scaling)
        return [DecoderLayer(cfg, rotary, backend, self.make_mlp(cfg, i))
                for i in self.stage.layer_range(cfg.num_layers)]

    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return MLP(cfg)  # layer ``layer``'s feed-forward block: a subclass may choose per layer

    def tie_weights(self) -> None:
        """Share the input embedding with the output head where the config says so (again
        after ``to_empty``, which unties parameters)."""
        if self.config.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states (normalised); on a stage before the last, the stream sent on."""
        x, delta = stage_inputs(self, input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, delta = layer(positions, x, delta, kv_cache, meta)
        if not self.stage.is_last:
            return self.stage.send(x, delta)
        return self.norm(x) if delta is None else self.norm.add_and_norm(x, delta)[1]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather_last(logits)[:, : self.config.vocab_size]
