"""A step's slots and block table for the sliding-window layers, where they keep blocks of
their own (``core/kv_window.py``): the same rows and positions as the full layers', read
through the batch's window tables."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from tidal.gpu.attention.metadata import AttentionMetadata
from tidal.gpu.input_batch import CachedRequestState, InputBatch


def window_inputs(meta: AttentionMetadata, window_table: np.ndarray, rows: np.ndarray,
                  token_rows: np.ndarray, positions: np.ndarray, bs: int,
                  to_dev: Callable[[np.ndarray], torch.Tensor]) -> None:
    """Fill ``meta``'s window table and slots for a step of any shape (``rows``: the
    requests' batch rows; ``token_rows`` and ``positions``: each token's)."""
    slots = window_table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
    meta.window_slot_mapping = to_dev(slots)
    meta.window_block_table = to_dev(np.ascontiguousarray(
        window_table[rows, : meta.block_table.shape[1]]))


def window_decode_inputs(meta: AttentionMetadata, batch: InputBatch,
                         states: Sequence[CachedRequestState], computed: list[int],
                         decode_inputs: Callable[..., Any], block_size: int) -> None:
    """``window_inputs`` for a step of one token per request, by the CPU kernels'
    ``decode_inputs`` (the call that built the full layers' ones)."""
    assert batch.window_block_table is not None
    *_, slots, _, _, table = decode_inputs(
        [s.row for s in states], computed, torch.from_numpy(batch.token_ids),
        torch.from_numpy(batch.window_block_table), block_size, meta.block_table.shape[1])
    meta.window_slot_mapping, meta.window_block_table = slots, table
