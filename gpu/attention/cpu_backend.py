"""The CPU attention backend: decode rows read the paged cache in place through C++ kernels
(``gpu/cpu_kernels.cpp``), which also store each step's keys and values.

Where the kernels cannot be built, ``get_attention_backend`` falls back to the torch backend,
which gathers each decode row's context into a copy first. Prefill chunks take the torch path
either way: they are compute-bound, and torch's fused attention runs them at GEMM speed.
"""

from __future__ import annotations

from types import ModuleType

import torch

from gpu.attention.metadata import AttentionMetadata
from gpu.attention.torch_ref import TorchAttentionBackend


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if key.dtype != key_cache.dtype:
            return super().write_kv(key, value, key_cache, value_cache, slot_mapping)
        self.kernels.write_kv(key, value, key_cache, value_cache, slot_mapping)

    def _decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, rows: list[int],
                out: torch.Tensor) -> None:
        """All decode rows in one pass whatever their lengths: softmax(q.k * scale) @ v."""
        qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        tokens = torch.tensor([qsl[i] for i in rows])
        row_index = torch.tensor(rows)
        max_len = max(lens[i] for i in rows)
        scores = torch.full((len(rows), query.shape[1], max_len), float("-inf"))
        self.kernels.decode_scores(scores, query, key_cache, meta.block_table, meta.seq_lens,
                                   row_index, tokens, scale)
        probs = torch.softmax(scores, dim=-1)
        self.kernels.decode_weighted_values(out, probs, value_cache, meta.block_table,
                                            meta.seq_lens, row_index, tokens)
