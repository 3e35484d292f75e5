"""The config facts of gpt-oss (``GptOssForCausalLM``) beyond a MoE Llama's, read from
``config.json``: which layers attend through a sliding window (``layer_types``, as Gemma's:
``gemma_config.layer_windows_of``) and the clamped SwiGLU of its experts (``swiglu_limit``,
``swiglu_alpha``). Its experts, router and attention biases, and attention sinks, are in every
gpt-oss model and need no setting; its YaRN rotary is ``rope_scaling``'s (``gpu/layers.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from tidal.gpu.gemma_config import layer_windows_of
from tidal.gpu.model_checks import ModelFileError

if TYPE_CHECKING:
    from tidal.gpu.model_config import ModelConfig

GPT_OSS = "GptOssForCausalLM"


@dataclass(frozen=True)
class GptOssFacts:
    layer_windows: tuple[int, ...]  # per layer: its sliding window, 0 for full attention
    swiglu_limit: float = 7.0  # the experts' gate clamped above, the up both ways, at this
    swiglu_alpha: float = 1.702  # the gain of the gate's sigmoid


def with_gpt_oss_facts(cfg: ModelConfig, raw: dict[str, Any], source: str) -> ModelConfig:
    """``cfg`` with its ``gpt_oss`` facts, and the output projection's bias where the
    attention has biases."""
    try:
        facts = GptOssFacts(
            layer_windows=layer_windows_of(raw, cfg.num_layers, pattern=2, source=source),
            swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        )
    except (TypeError, ValueError) as exc:
        raise ModelFileError(f"{source}: a gpt-oss setting has the wrong type: {exc}") from None
    rope = dict(cfg.rope_scaling)
    if rope.get("rope_type", rope.get("type")) == "yarn" and rope.get("factor") is None:
        old = rope.get("original_max_position_embeddings") or cfg.max_position_embeddings
        rope["factor"] = cfg.max_position_embeddings / old  # HF's default for a missing one
    return replace(cfg, gpt_oss=facts, o_bias=cfg.qkv_bias, rope_scaling=rope)
