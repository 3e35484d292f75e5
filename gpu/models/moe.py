"""Mixture-of-experts decoders: Qwen3-MoE and Mixtral.

The Llama-family decoder of ``llama.py`` (attention, norms, residual stream; q/k norms where
the config has them, as Qwen3-MoE does) with a ``MoE`` block (``gpu/moe.py``) in place of the
dense MLP in the layers the config makes sparse: every layer of Mixtral; Qwen3-MoE's per
``decoder_sparse_step`` and ``mlp_only_layers``, its other layers a dense MLP of
``intermediate_size``. The two differ only in routing: Mixtral always renormalises its top-2
weights and applies them in float32, Qwen3-MoE renormalises where ``norm_topk_prob`` says and
rounds them to the model's dtype first (each as HF transformers runs it).
"""

from __future__ import annotations

from torch import nn

from tidal.gpu.model_config import ModelConfig
from tidal.gpu.models.llama import MLP, LlamaForCausalLM
from tidal.gpu.moe import MoE, Routing


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    float32_weights = False  # whether routing weights multiply the experts' outputs in float32

    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        if not cfg.is_moe_layer(layer):
            return MLP(cfg)
        routing = Routing(cfg.num_experts_per_tok, cfg.norm_topk_prob, self.float32_weights)
        return MoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, routing)


class MixtralForCausalLM(Qwen3MoeForCausalLM):
    float32_weights = True  # its config's norm_topk_prob is always set (model_config.py)
