"""The config facts of Gemma 2 and Gemma 3 (text) beyond a Llama's, read from ``config.json``.

Which layers attend through a sliding window (``layer_types``, or in older configs a pattern:
every ``sliding_window_pattern``-th layer global, the others sliding), the attention scale
(``query_pre_attn_scalar``), the soft-capping of attention and final logits (Gemma 2), and the
rotary settings of the local (sliding) layers beside the global ones (Gemma 3:
``rope_parameters`` by layer type, or ``rope_local_base_freq``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from tidal.gpu.model_checks import ModelFileError

if TYPE_CHECKING:
    from tidal.gpu.model_config import ModelConfig

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Each architecture's defaults where a config leaves a setting out (HF's config classes).
_DEFAULTS = {
    "Gemma2ForCausalLM": dict(pattern=2, global_theta=10_000.0, local_theta=10_000.0,
                              attn_softcap=50.0, final_softcap=30.0),
    "Gemma3ForCausalLM": dict(pattern=6, global_theta=1_000_000.0, local_theta=10_000.0,
                              attn_softcap=None, final_softcap=None),
}
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class GemmaFacts:
    layer_windows: tuple[int, ...]  # per layer: its sliding window, 0 for global attention
    query_pre_attn_scalar: float  # the attention scale is its inverse square root
    attn_softcap: float = 0.0  # 0: attention logits not soft-capped
    final_softcap: float = 0.0  # 0: final logits not soft-capped
    local_rope_theta: float = 10_000.0  # the sliding layers' rotary base
    local_rope_scaling: dict = field(default_factory=dict)


def with_gemma_facts(cfg: ModelConfig, raw: dict[str, Any], source: str) -> ModelConfig:
    """``cfg`` with its ``gemma`` facts, and its rotary settings those of the global layers."""
    defaults = _DEFAULTS[cfg.architecture]
    if raw.get("use_bidirectional_attention"):
        raise ModelFileError(f"{source}: bidirectional attention (an encoder's) is unsupported")
    activation = raw.get("hidden_activation") or raw.get("hidden_act") or _GELU_TANH[0]
    if activation not in _GELU_TANH:
        raise ModelFileError(f"{source}: hidden_activation {activation!r} is unsupported; "
                             f"Gemma's is {_GELU_TANH[0]}")
    global_rope, local_rope = _rope_settings(raw, defaults,
                                             shared=cfg.architecture == GEMMA_ARCHITECTURES[0])
    try:
        facts = GemmaFacts(
            layer_windows=layer_windows_of(raw, cfg.num_layers, defaults["pattern"], source),
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or cfg.head_dim),
            attn_softcap=float(raw.get("attn_logit_softcapping", defaults["attn_softcap"]) or 0),
            final_softcap=float(raw.get("final_logit_softcapping", defaults["final_softcap"])
                                or 0),
            local_rope_theta=float(local_rope.pop("rope_theta")),
            local_rope_scaling=local_rope,
        )
        global_theta = float(global_rope.pop("rope_theta"))
    except (TypeError, ValueError) as exc:
        raise ModelFileError(f"{source}: a Gemma setting has the wrong type: {exc}") from None
    return replace(cfg, rope_theta=global_theta, rope_scaling=global_rope, gemma=facts)


def layer_windows_of(raw: dict[str, Any], num_layers: int, pattern: int,
                     source: str) -> tuple[int, ...]:
    window = raw.get("sliding_window") or 0
    if not isinstance(window, int) or window < 0:
        raise ModelFileError(f"{source}: sliding_window must be a positive integer")
    types = raw.get("layer_types")
    if types is None:
        pattern = raw.get("sliding_window_pattern") or pattern
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or set(types) - {SLIDING, FULL}:
        raise ModelFileError(f"{source}: layer_types must name {num_layers} layers, each "
                             f"{SLIDING!r} or {FULL!r}")
    return tuple(window if kind == SLIDING else 0 for kind in types)


def _rope_settings(raw: dict[str, Any], defaults: dict, shared: bool) -> tuple[dict, dict]:
    """The global and the local layers' rotary settings, each a dict with ``rope_theta``;
    ``shared``: one setting for both (Gemma 2)."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        rope = {}
    if FULL in rope or SLIDING in rope:  # by layer type (transformers 5's Gemma 3 configs)
        global_rope, local_rope = dict(rope.get(FULL) or {}), dict(rope.get(SLIDING) or {})
    else:
        global_rope, local_rope = dict(rope), {}
    global_rope.setdefault("rope_theta", raw.get("rope_theta", defaults["global_theta"]))
    if shared:
        return global_rope, dict(global_rope)
    local_rope.setdefault("rope_theta",
                          raw.get("rope_local_base_freq", defaults["local_theta"]))
    return global_rope, local_rope
