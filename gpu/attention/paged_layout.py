"""Synthetic paged KV layouts: requests over shuffled physical blocks, for the kernel selector's
timings, the attention tests and benchmarks."""

from __future__ import annotations

import torch

from tidal.gpu.attention.metadata import AttentionMetadata


def paged_layout(context: list[int], query: list[int], block_size: int, seed: int,
                 pad_rows: int = 0, device: str = "cpu") -> AttentionMetadata:
    """Requests whose ``query[i]`` last tokens of ``context[i] + query[i]`` are computed,
    over shuffled physical blocks; ``pad_rows`` padded query rows (slot -1) at the end."""
    seq_lens = [c + q for c, q in zip(context, query)]
    width = max(-(-s // block_size) for s in seq_lens)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = len(seq_lens) * width + 3
    table = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * width]
    table = table.view(len(seq_lens), width).to(torch.int32)
    cu = [0]
    slots: list[int] = []
    for i, (c, q) in enumerate(zip(context, query)):
        cu.append(cu[-1] + q)
        slots += [int(table[i, p // block_size]) * block_size + p % block_size
                  for p in range(c, c + q)]
    slots += [-1] * pad_rows
    return AttentionMetadata(
        num_actual_tokens=cu[-1],
        query_start_loc=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=table.to(device), slot_mapping=torch.tensor(slots, device=device),
        max_query_len=max(query), max_seq_len=max(seq_lens), query_start_loc_cpu=cu,
        seq_lens_cpu=seq_lens)


def random_caches(meta: AttentionMetadata, block_size: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Random key and value caches on ``meta``'s device, large enough for its block table."""
    num_blocks = int(meta.block_table.max()) + 4
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    device = meta.block_table.device
    return (torch.randn(shape, device=device).to(dtype),
            torch.randn(shape, device=device).to(dtype))
