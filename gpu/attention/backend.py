"""The attention backend interface: how a layer writes its K/V and attends over the cache."""

from __future__ import annotations

from typing import Protocol

import torch

from tidal.gpu.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
        """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` at their slots;
        into an int8 cache quantized, with their scales (``gpu.attention.kv_quant``)."""

    def forward(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None, window: int = 0,
                softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Causal paged attention. ``query`` is ``[num_tokens, num_heads, head_dim]``
        (``num_heads`` a multiple of ``num_kv_heads``); returns the same shape. An int8 cache
        comes with its scales ``[num_blocks, block_size, num_kv_heads]``. A sliding-window
        layer gives its ``window`` (a row at position p sees keys at positions > p - window;
        0: every earlier one), a soft-capping one its ``softcap`` (scores s become
        softcap * tanh(s / softcap); 0: none), a layer with attention sinks its ``sinks``
        ``[num_heads]`` (a logit per query head added to each row's softmax denominator,
        with no value; None: none): per call, as layers differ."""
