"""CUDA graphs for decode-only steps.

A decode step launches a few hundred small kernels whose launch time, not their work, bounds
the step at small batches. Each padded batch size (1, 2, 4, 8, then steps of 16, up to the
first that holds ``max_num_seqs``) gets one graph of the model's forward, captured once after
the KV cache is allocated. With speculative decoding a step that verifies proposals runs each
of them as a one-token row of its own (``gpu/spec_step.py``), so it is a decode step too, and
the sizes go on up to the ``k + 1`` rows of every request (``graph_rows``); a draft model's
decode-shaped forwards replay graphs of their own. All graphs read the same static input
buffers (token ids, positions, sequence lengths, block table, slot mapping) and share one
memory pool, largest captured first.

A step is replayed at the smallest captured size that holds its requests; the padded requests
have ``seq_len`` 0 and slot ``-1``, so they read and write no KV cache. Graph capture bakes in
every host-side value, so the attention backend must read lengths only from device tensors:
the Triton backend does (its decode split count follows ``max_seq_len``, which capture sets to
the model's context length). Prefill and mixed steps, and decode batches above the largest size,
run eagerly.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

from tidal.gpu.attention import AttentionMetadata

logger = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class Replayable(Protocol):
    def replay(self) -> None: ...


MAX_SPEC_ROWS = 512  # the most one-token rows a speculating step's graphs are captured for


def capture_sizes(max_rows: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, up to the first that holds ``max_rows``: a step of
    the most rows replays a graph too."""
    sizes = [1]
    while sizes[-1] < max_rows:
        sizes.append(sizes[-1] * 2 if sizes[-1] < 16 else sizes[-1] + 16)
    return sizes


def graph_rows(max_num_seqs: int, rows_per_seq: int, max_num_batched_tokens: int) -> int:
    """The most rows a captured graph takes: a decode step's one a request, or, where a step
    verifies proposals, each request's ``rows_per_seq`` (its proposals and one more, run as
    one-token rows: ``gpu/spec_step.py``), up to ``MAX_SPEC_ROWS`` and the step's budget."""
    if rows_per_seq <= 1:
        return max_num_seqs
    return max(max_num_seqs, min(max_num_seqs * rows_per_seq, MAX_SPEC_ROWS,
                                 max_num_batched_tokens))


class CudaGraphRunner:
    """Captures ``forward(input_ids, positions, meta) -> hidden`` at padded batch sizes and
    replays it for decode-only steps (one query row a request, up to ``max_rows`` rows)."""

    def __init__(self, forward: Forward, max_rows: int, max_blocks_per_req: int,
                 max_model_len: int, device: str, windowed: bool = False) -> None:
        self.forward = forward
        self.sizes = capture_sizes(max_rows)
        self.max_model_len = max_model_len
        n = self.sizes[-1]
        with torch.device(device):
            self.input_ids = torch.zeros(n, dtype=torch.long)
            self.positions = torch.zeros(n, dtype=torch.long)
            self.seq_lens = torch.zeros(n, dtype=torch.int32)
            self.query_start_loc = torch.arange(n + 1, dtype=torch.int32)
            self.block_table = torch.zeros(n, max_blocks_per_req, dtype=torch.int32)
            self.slot_mapping = torch.full((n,), -1, dtype=torch.long)
            # the sliding-window layers' own table and slots (core/kv_window.py)
            self.window_block_table = (torch.zeros(n, max_blocks_per_req, dtype=torch.int32)
                                       if windowed else None)
            self.window_slot_mapping = (torch.full((n,), -1, dtype=torch.long) if windowed
                                        else None)
        self.graphs: dict[int, Replayable] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def can_run(self, meta: AttentionMetadata) -> bool:
        return meta.is_decode_only and self.holds(meta.num_reqs)

    def holds(self, rows: int) -> bool:
        """Whether a decode step of ``rows`` one-token rows replays a graph."""
        return bool(self.graphs) and rows <= self.max_size

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        for size in reversed(self.sizes):
            meta = self._static_meta(size)
            self.forward(self.input_ids[:size], self.positions[:size], meta)  # compile, warm
            self.graphs[size], self.outputs[size] = self._capture_one(size, meta)
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s",
                    len(self.graphs), self.sizes, time.perf_counter() - start)

    def _capture_one(self, size: int, meta: AttentionMetadata) -> tuple[Replayable, torch.Tensor]:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.forward(self.input_ids[:size], self.positions[:size], meta)
        if self.pool is None:
            self.pool = graph.pool()
        return graph, out

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """Copy a decode step's inputs into the static buffers (device to device, no sync),
        replay the graph of the smallest size that fits, and return its hidden states."""
        n = meta.num_reqs
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.input_ids[:n].copy_(input_ids[:n], non_blocking=True)
        self.positions[:n].copy_(positions[:n], non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[n:size].zero_()
        width = meta.block_table.shape[1]
        self.block_table[:n, :width].copy_(meta.block_table, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping[:n], non_blocking=True)
        self.slot_mapping[n:size].fill_(-1)
        if self.window_block_table is not None and self.window_slot_mapping is not None:
            assert meta.window_block_table is not None and meta.window_slot_mapping is not None
            self.window_block_table[:n, :width].copy_(meta.window_block_table, non_blocking=True)
            self.window_slot_mapping[:n].copy_(meta.window_slot_mapping[:n], non_blocking=True)
            self.window_slot_mapping[n:size].fill_(-1)
        self.graphs[size].replay()
        return self.outputs[size][:n]

    def _static_meta(self, size: int) -> AttentionMetadata:
        """The metadata the graph of ``size`` is captured with: views of the static buffers,
        and the longest context as ``max_seq_len`` so its launch shapes fit every step."""
        return AttentionMetadata(
            num_actual_tokens=size,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[self.max_model_len] * size,
            window_block_table=(self.window_block_table[:size]
                                if self.window_block_table is not None else None),
            window_slot_mapping=(self.window_slot_mapping[:size]
                                 if self.window_slot_mapping is not None else None),
        )
