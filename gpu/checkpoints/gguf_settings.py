"""The settings of the newer GGUF architectures, as their ``config.json`` would name them:
Gemma 2 / 3 (soft-caps, windows, and what llama.cpp fixes rather than records) and the
mixture-of-experts files (``qwen3moe``; Mixtral's ``llama`` with experts). ``meta`` is
``gguf_file.Metadata``."""

from __future__ import annotations

from typing import Any

GEMMAS = ("gemma2", "gemma3")
# llama.cpp's fixed choices for Gemma that its files do not record: every n-th layer global,
# the local layers' rotary base, and the sizes (by layer count) whose attention scale is
# hidden / heads rather than the head size (Gemma 2 27B, Gemma 3 27B)
_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA_LOCAL_THETA = 10_000.0
_GEMMA_HIDDEN_SCALED = {"gemma2": 46, "gemma3": 62}


def gemma_config(meta: Any, hidden: int, heads: int) -> dict[str, Any]:
    """Gemma's settings as its ``config.json`` names them: the soft-caps and the window from
    the metadata, the rest as llama.cpp fixes them (``_GEMMA_*``)."""
    if meta.arch not in GEMMAS:
        return {}
    layers = meta.int("block_count")
    head_dim = meta.int("attention.key_length", hidden // heads)
    scalar = hidden // heads if layers == _GEMMA_HIDDEN_SCALED[meta.arch] else head_dim
    caps = {key: meta.float(key, 0.0) or None
            for key in ("attn_logit_softcapping", "final_logit_softcapping")}
    return {"sliding_window": meta.int("attention.sliding_window", 0) or None,
            **_window_pattern(meta, layers),
            "query_pre_attn_scalar": scalar,
            "rope_local_base_freq": meta.float("rope.freq_base_swa", _GEMMA_LOCAL_THETA),
            "hidden_activation": "gelu_pytorch_tanh", **caps}


def _window_pattern(meta: Any, layers: int) -> dict[str, Any]:
    """Which layers slide: the file's ``attention.sliding_window_pattern`` (every n-th layer
    global, or a flag per layer, true where it slides), else llama.cpp's fixed pattern."""
    pattern = meta.get("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(f"GGUF {meta.arch}.attention.sliding_window_pattern names "
                             f"{len(pattern)} layers, not {layers}")
        return {"layer_types": ["sliding_attention" if slides else "full_attention"
                                for slides in pattern]}
    return {"sliding_window_pattern": int(pattern or _GEMMA_PATTERN[meta.arch])}


def moe_config(meta: Any) -> dict[str, Any]:
    """The experts' settings as Qwen3-MoE's or Mixtral's ``config.json`` names them; the
    layers without stacked experts are Qwen3-MoE's dense ``mlp_only_layers``."""
    if not meta.get("expert_count"):
        return {}
    moe: dict[str, Any] = {"num_local_experts": meta.int("expert_count"),
                           "num_experts_per_tok": meta.int("expert_used_count")}
    if meta.arch == "qwen3moe":
        sparse = {int(t.name.split(".")[1]) for t in meta.reader.tensors
                  if t.name.endswith(".ffn_gate_exps.weight")}
        moe.update(moe_intermediate_size=meta.int("expert_feed_forward_length"),
                   norm_topk_prob=True,  # as llama.cpp's qwen3moe graph always does
                   mlp_only_layers=[i for i in range(meta.int("block_count"))
                                    if i not in sparse])
    return moe
