"""The Triton attention backend: the GPU default, and runnable on the CPU in Triton's
interpreter for tests.

Decode-only steps take the split-K decode kernel; prefill and mixed steps take the varlen
kernel (decode rows of a mixed step ride along as one-token chunks). Nothing here reads a device
tensor on the host, so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from tidal.gpu.attention import triton_kernels as kernels
from tidal.gpu.attention.metadata import AttentionMetadata


class TritonAttentionBackend:
    name = "triton"

    def __init__(self) -> None:
        if not torch.cuda.is_available() and not kernels.interpreting():
            raise ValueError("the triton attention backend needs a CUDA device, or "
                             "TRITON_INTERPRET=1 to run its kernels on the CPU")

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
        kernels.write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)

    def forward(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None, window: int = 0,
                softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty_like(query)
        if meta.is_decode_only:
            rows = meta.num_reqs  # one query row per request, in request order
            kernels.paged_decode(query[:rows], key_cache, value_cache, meta.block_table,
                                 meta.seq_lens, scale, meta.max_seq_len, out=out[:rows],
                                 k_scale=k_scale, v_scale=v_scale, window=window,
                                 softcap=softcap, sinks=sinks)
        else:
            rows = meta.num_actual_tokens
            kernels.paged_prefill(query, key_cache, value_cache, meta.block_table,
                                  meta.seq_lens, meta.query_start_loc, scale,
                                  meta.max_query_len, out=out, k_scale=k_scale,
                                  v_scale=v_scale, window=window, softcap=softcap,
                                  sinks=sinks)
        if query.shape[0] > rows:  # padding rows: zeros, as the torch backend gives
            out[rows:].zero_()
        return out
