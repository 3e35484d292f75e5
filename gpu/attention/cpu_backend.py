"""The CPU attention backend: decode rows are attended in one pass over the paged cache by a
C++ kernel (``gpu/cpu/csrc/attention.cpp``), every float32 prefill chunk of a step in one call by
another (``gpu/cpu/csrc/prefill_attention.cpp``), and each step's keys and values are stored by a
third.

Layers with attention sinks (gpt-oss) take the kernels too: a sink joins each row's softmax
sum with no value.

Where the kernels cannot be built, ``get_attention_backend`` falls back to the torch backend,
which gathers each request's context into a copy first and attends prefill chunks one request
at a time.
"""

from __future__ import annotations

from types import ModuleType

import torch

from tidal.gpu.attention.metadata import AttentionMetadata
from tidal.gpu.attention.torch_ref import Scale, Sinks, TorchAttentionBackend
from tidal.gpu.cpu.kernels import KERNEL_DTYPES
from tidal.gpu.cpu.selector import KERNELS, Plan


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels
        # Which rows the kernels take (None: every row), timed on the host by gpu/cpu/op_plans:
        # decode rows by their count, prefill chunks by the step's prefill tokens.
        self.decode_plan: Plan | None = None
        self.prefill_plan: Plan | None = None

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scale: Scale = None, v_scale: Scale = None) -> None:
        if not _kernel_dtypes(key, value, key_cache, value_cache):
            return super().write_kv(key, value, key_cache, value_cache, slot_mapping,
                                    k_scale, v_scale)
        self.kernels.write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)

    def _decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, out: torch.Tensor,
                scales: tuple[Scale, Scale] = (None, None), window: int = 0,
                softcap: float = 0.0, sinks: Sinks = None) -> None:
        """softmax(q.k * scale) @ v for every decode row in one call: each row reads only its
        own context (its last ``window`` positions, where a window is given), so rows of any
        lengths go together."""
        if not (_kernel_dtypes(query, key_cache, value_cache, out)
                and self.kernels.decode_attention_supports(query.shape[-1])
                and _chosen(self.decode_plan, len(meta.decode_requests))):
            return super()._decode(query, key_cache, value_cache, meta, scale, out, scales,
                                   window, softcap, sinks)
        requests, query_rows = meta.decode_rows_cpu
        self.kernels.decode_attention(out, query, key_cache, value_cache, meta.block_table,
                                      meta.seq_lens, requests, query_rows, scale, *scales,
                                      window=window, softcap=softcap, sinks=_float(sinks))

    def _prefill(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float, out: torch.Tensor,
                 scales: tuple[Scale, Scale] = (None, None), window: int = 0,
                 softcap: float = 0.0, sinks: Sinks = None) -> None:
        """Every prefill chunk in one call; the kernel takes float32 only, and torch's fused
        attention keeps the half-precision chunks."""
        if not (query.dtype == torch.float32
                and _kernel_dtypes(query, key_cache, value_cache, out)
                and self.kernels.decode_attention_supports(query.shape[-1])
                and _chosen(self.prefill_plan, meta.num_actual_tokens)):
            return super()._prefill(query, key_cache, value_cache, meta, scale, out, scales,
                                    window, softcap, sinks)
        self.kernels.prefill_attention(out, query, key_cache, value_cache, meta.block_table,
                                       meta.seq_lens, meta.query_start_loc,
                                       meta.prefill_requests_cpu, scale, *scales,
                                       window=window, softcap=softcap, sinks=_float(sinks))


def _float(sinks: Sinks) -> torch.Tensor | None:
    """The kernels take sinks as contiguous float32."""
    return None if sinks is None else sinks.detach().float().contiguous()


def _kernel_dtypes(*tensors: torch.Tensor) -> bool:
    """The kernels take float32, bfloat16 and float16, one dtype throughout, except that the
    caches (the last two tensors given) may be int8 (with scales) whatever the others are."""
    dtype = tensors[0].dtype
    caches = [t for t in tensors if t.dtype == torch.int8]
    return dtype in KERNEL_DTYPES and all(t.dtype == dtype for t in tensors
                                          if t.dtype != torch.int8) and len(caches) in (0, 2)


def _chosen(plan: Plan | None, rows: int) -> bool:
    return plan is None or plan.pick(rows) == KERNELS
