"""Per-step attention metadata shared by every attention backend.

Tokens of all requests in a step are flattened into one batch (no padding between requests).
Request ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``; those are the last
tokens of its context, whose total length after this step is ``seq_lens[i]``. Its keys and values
live in the paged cache at the blocks listed in ``block_table[i]``.

KV cache layout per layer: ``key_cache`` and ``value_cache`` are each
``[num_blocks, block_size, num_kv_heads, head_dim]``; token at position ``p`` of request ``i``
lives at slot ``block_table[i, p // block_size] * block_size + p % block_size``.

A model whose sliding-window layers keep blocks of their own (``core/kv_window.py``) sends
their table and slots too; those layers attend over ``windowed``, the same step seen through
them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    num_actual_tokens: int  # tokens to attend for; rows past this are padding
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on the device
    seq_lens: torch.Tensor  # [num_reqs] int32, on the device
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, on the device
    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 marks a padded slot to skip
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]  # host copies, so no backend needs a device sync
    seq_lens_cpu: list[int]
    # the sliding-window layers' own table and slots; None where they share the above
    window_block_table: torch.Tensor | None = None
    window_slot_mapping: torch.Tensor | None = None

    @functools.cached_property
    def windowed(self) -> AttentionMetadata:
        """This step as the sliding-window layers see it: their own table and slots."""
        if self.window_block_table is None:
            return self
        return replace(self, block_table=self.window_block_table,
                       slot_mapping=self.window_slot_mapping, window_block_table=None,
                       window_slot_mapping=None)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @functools.cached_property
    def decode_requests(self) -> list[int]:
        """The requests with one query row this step, worked out once for every layer."""
        qsl = self.query_start_loc_cpu
        return [i for i in range(self.num_reqs) if qsl[i + 1] - qsl[i] == 1]

    @functools.cached_property
    def prefill_requests(self) -> list[int]:
        """The requests with more than one query row this step (prefill chunks)."""
        qsl = self.query_start_loc_cpu
        return [i for i in range(self.num_reqs) if qsl[i + 1] - qsl[i] > 1]

    @functools.cached_property
    def prefill_requests_cpu(self) -> torch.Tensor:
        """``prefill_requests`` as an int64 CPU tensor, built once a step for the kernels."""
        return torch.tensor(self.prefill_requests, dtype=torch.int64)

    @functools.cached_property
    def decode_rows_cpu(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode requests and their query rows as int64 CPU tensors, for kernels that
        take index tensors: built once a step, not once a layer."""
        requests = np.asarray(self.decode_requests, dtype=np.int64)
        # via numpy: torch.tensor over a list of a few dozen ints took as long as 20 us
        rows = np.asarray(self.query_start_loc_cpu, dtype=np.int64)[requests]
        return torch.from_numpy(requests), torch.from_numpy(rows)
