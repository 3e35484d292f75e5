"""gpt-oss GGUF files (llama.cpp's ``gpt-oss`` architecture) read into the form of gpt-oss's
Hugging Face checkpoints, which ``gpu/moe_weights.py``'s ``gpt_oss_layout`` then takes as it
takes those.

llama.cpp's converter splits the checkpoint's interleaved ``gate_up_proj`` ``[E, H, 2I]`` into
``blk.N.ffn_gate_exps`` and ``ffn_up_exps`` ``[E, I, H]`` (newer ones may write them fused,
``ffn_gate_up_exps`` ``[E, 2I, H]``, the gate rows first), transposes ``down_proj`` into
``ffn_down_exps`` ``[E, H, I]``, splits the biases alike, and keeps the experts in MXFP4 blocks
(read as codebook weights where MXFP4, ``gguf_file._experts``; other types dequantized here into
floats). Those are put back: gate and up rows interleaved and
transposed, ``down_proj`` transposed, and the router (``ffn_gate_inp``) and the attention sinks
(``attn_sinks``) under their checkpoint names.

What the file does not record is what llama.cpp fixes: even layers sliding, odd full; the
experts' SwiGLU clamped at 7; YaRN without truncation as gpt-oss's config says.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

GPT_OSS_ARCH = "gpt-oss"
# a layer's GGUF part -> its name in a gpt-oss checkpoint (under model.layers.N.)
LAYER_NAMES = {"attn_sinks": "self_attn.sinks", "post_attention_norm": "post_attention_layernorm",
               "ffn_gate_inp": "mlp.router"}
_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_gate_up_exps", "ffn_down_exps")
SWIGLU_LIMIT = 7.0


def is_expert_part(part: str) -> bool:
    return part in _EXPERTS


class ExpertPairs:
    """A layer's expert tensors as they arrive, yielded in the checkpoint's form once whole."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, str], dict[str, torch.Tensor]] = {}

    def add(self, layer: str, part: str, kind: str, value: torch.Tensor
            ) -> Iterator[tuple[str, torch.Tensor]]:
        prefix = f"model.layers.{layer}.mlp.experts"
        suffix = "_bias" if kind == "bias" else ""
        if part == "ffn_down_exps":  # [E, H, I] -> [E, I, H]; its bias [E, H] as it is
            yield f"{prefix}.down_proj{suffix}", value if suffix else value.transpose(1, 2)
            return
        if part == "ffn_gate_up_exps":  # gate rows then up rows
            gate, up = value.chunk(2, dim=1 if kind == "weight" else -1)
        else:
            held = self._held.setdefault((layer, kind), {})
            held[part] = value
            if len(held) < 2:
                return
            del self._held[(layer, kind)]
            gate, up = held["ffn_gate_exps"], held["ffn_up_exps"]
        both = torch.stack([gate, up], dim=2 if kind == "weight" else -1)
        if kind == "weight":  # [E, I, 2, H] -> rows interleaved [E, 2I, H] -> [E, H, 2I]
            yield f"{prefix}.gate_up_proj", both.flatten(1, 2).transpose(1, 2)
        else:
            yield f"{prefix}.gate_up_proj_bias", both.flatten(-2)

    def check_done(self) -> None:
        if self._held:
            raise ValueError(f"GGUF gpt-oss experts lack their gate or up half: "
                             f"{sorted(self._held)}")


def gpt_oss_config(meta: Any) -> dict[str, Any]:
    """gpt-oss's ``config.json`` settings beyond a Llama's."""
    layers = meta.int("block_count")
    return {
        "num_local_experts": meta.int("expert_count"),
        "num_experts_per_tok": meta.int("expert_used_count"),
        "intermediate_size": meta.int("expert_feed_forward_length"),
        "sliding_window": meta.int("attention.sliding_window"),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                        for i in range(layers)],
        "attention_bias": True,
        "swiglu_limit": SWIGLU_LIMIT,
    }
