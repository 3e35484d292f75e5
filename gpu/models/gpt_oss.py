"""gpt-oss (``GptOssForCausalLM``) over the Llama model's parts and the MoE block.

What differs from a Llama with experts (``gpu/models/moe.py``): the q/k/v and output
projections have biases; each attention layer has sinks, a learned logit per head that joins
its rows' softmax denominators (handed to the backend with every call, as a window is); layers
alternate between sliding-window and full attention (``layer_types``); the rotary is YaRN's
(``gpu/layers.py``); every layer's MLP is a MoE whose router and experts have biases, whose
experts' activation is a clamped SwiGLU, and whose routing takes the top-k of the router's
logits and then the softmax over those k (``gpu/moe.py``).

Its checkpoints' experts and router are put in the MoE block's layout as they are read
(``gpu/moe_weights.py``, ``gpt_oss_layout``).

HF's gpt-oss RMSNorm scales in float32 before rounding, ours in the model's dtype: the same in
float32, a rounding apart in half precision.
"""

from __future__ import annotations

import torch
from torch import nn

from tidal.gpu.attention import AttentionBackend
from tidal.gpu.layers import ClampedSwiGLU
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.models.llama import LlamaForCausalLM
from tidal.gpu.moe import MoE, Routing


class GptOssForCausalLM(LlamaForCausalLM):
    one_call_decode = False  # the C++ decode step has no sinks, biases or this MoE

    def build_layers(self, cfg: ModelConfig, backend: AttentionBackend) -> list[nn.Module]:
        if cfg.gpt_oss is None:
            raise ValueError(f"{cfg.architecture} config lacks its gpt-oss facts")
        layers = super().build_layers(cfg, backend)
        for layer, window in zip(layers, cfg.gpt_oss.layer_windows):
            layer.self_attn.window = window
            layer.self_attn.sinks = nn.Parameter(torch.empty(cfg.num_heads))
        return layers

    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        assert cfg.gpt_oss is not None
        routing = Routing(cfg.num_experts_per_tok, renormalize=False, softmax_after_topk=True)
        activation = ClampedSwiGLU(cfg.gpt_oss.swiglu_limit, cfg.gpt_oss.swiglu_alpha)
        return MoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, routing,
                   bias=True, activation=activation)
