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
from gpu.cpu_kernels import KERNEL_DTYPES


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if not _kernel_dtypes(key, value, key_cache, value_cache):
            return super().write_kv(key, value, key_cache, value_cache, slot_mapping)
        self.kernels.write_kv(key, value, key_cache, value_cache, slot_mapping)

    def _decode_group(self, query: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                      requests: list[int], out: torch.Tensor) -> None:
        """softmax(q.k * scale) @ v for a group of decode requests of similar lengths (the
        base class groups them, so one long context does not widen every row's scores)."""
        if not _kernel_dtypes(query, key_cache, value_cache, out):
            return super()._decode_group(query, key_cache, value_cache, meta, scale, requests,
                                         out)
        qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        query_rows = torch.tensor([qsl[i] for i in requests])
        request_index = torch.tensor(requests)
        max_len = max(lens[i] for i in requests)
        scores = torch.full((len(requests), query.shape[1], max_len), float("-inf"))
        self.kernels.decode_scores(scores, query, key_cache, meta.block_table, meta.seq_lens,
                                   request_index, query_rows, scale)
        probs = torch.softmax(scores, dim=-1)
        self.kernels.decode_weighted_values(out, probs, value_cache, meta.block_table,
                                            meta.seq_lens, request_index, query_rows)


def _kernel_dtypes(*tensors: torch.Tensor) -> bool:
    """The kernels take float32, bfloat16 and float16, one dtype throughout."""
    dtype = tensors[0].dtype
    return dtype in KERNEL_DTYPES and all(t.dtype == dtype for t in tensors)
