"""gpt-oss's parts against HF transformers' own: the YaRN rotary table against
``_compute_yarn_parameters`` and HF's rotary module, and the MoE block (clamped SwiGLU, biases,
top-k-then-softmax routing) against ``GptOssMLP``, its weights laid out by the model's
``gpt_oss_layout`` (the loader's) from HF's interleaved form."""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP, GptOssRotaryEmbedding

from tidal.gpu.layers import _rotary_table
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.models.gpt_oss import GptOssForCausalLM
from tidal.gpu.moe import MoE
from tidal.gpu.moe_weights import gpt_oss_layout

HEAD_DIM, POSITIONS = 32, 300


def _config(**rope: object) -> GptOssConfig:
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "original_max_position_embeddings": 64, **rope}
    return GptOssConfig(hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                        num_local_experts=4, num_experts_per_tok=2, swiglu_limit=1.0,
                        max_position_embeddings=512, rope_parameters=rope)


@pytest.mark.parametrize("rope", [{"truncate": False}, {"truncate": True},
                                  {"truncate": False, "attention_factor": 1.3}])
def test_yarn_table_matches_hf(rope):
    config = _config(**rope)
    hf = GptOssRotaryEmbedding(config)
    positions = torch.arange(POSITIONS)[None]
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), positions)  # [1, P, D/2]
    ours_cos, ours_sin = _rotary_table(HEAD_DIM, POSITIONS, 150000.0, config.rope_parameters)
    torch.testing.assert_close(ours_cos[:, :HEAD_DIM // 2], cos[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_sin[:, HEAD_DIM // 2:], sin[0], atol=1e-5, rtol=1e-5)


def test_moe_block_matches_hf():
    config = _config()
    torch.manual_seed(0)
    hf = GptOssMLP(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    cfg = ModelConfig.from_hf_dict({**config.to_dict(), "architectures": ["GptOssForCausalLM"]},
                                   [])
    ours = GptOssForCausalLM.make_mlp(None, cfg, 0)  # type: ignore[arg-type]
    assert isinstance(ours, MoE)
    hf_weights = {f"model.layers.0.mlp.{n}": p.detach() for n, p in hf.named_parameters()}
    params = dict(ours.named_parameters())
    for name, value in gpt_oss_layout(hf_weights.items()):
        with torch.no_grad():
            params[name.removeprefix("layers.0.mlp.")].copy_(value)
    x = torch.randn(7, 64)
    want, _ = hf(x[None])
    torch.testing.assert_close(ours(x), want[0], atol=1e-5, rtol=1e-5)
