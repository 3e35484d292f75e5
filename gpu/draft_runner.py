"""Speculative decoding's draft model: a small model with the target's vocabulary, run by the
model runner right after the target's step, whose greedy guesses the next step verifies
(docs/speculative-decoding.md).

The draft's layers have KV tensors of their own but share the target's block ids: a request's
block table addresses both caches, so chunked prefill, prefix caching, preemption and
roll-back need nothing of their own. After each speculating step the draft
- runs the tokens the target computed and kept since the draft last ran (a prefill chunk; a
  decode's last token and accepted proposals; what plain steps computed without it), plus, for
  a request that sampled, its new last token: its KV then holds every known token the target's
  does, and its logits there give the first proposal;
- then runs ``k - 1`` one-token forwards, each from its own previous guess.
A plain step (``SchedulerOutput.propose_drafts`` off) runs no draft forward at all.
Positions past a request's known tokens are written before they are read (the next step's
catch-up writes them again with the verified tokens), so a rejected guess's KV is never read.
Positions past the blocks the scheduler gave a request go to scratch blocks after the shared
ones, the draft's alone: each step's guesses need them only within that step.

A block the target filled in plain steps holds no draft KV, so a prefix hit cannot vouch for
the draft's. Each full block the draft has written carries a key of the tokens up to its end
(``block_keys``, the prefix cache's chained hash); a request the draft first follows keeps the
leading blocks whose keys match its own tokens and has the draft run the rest.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tidal.core.block_pool import BlockHash, hash_block_tokens
from tidal.core.config import EngineConfig
from tidal.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from tidal.core.speculative_config import SpeculativeConfig, resolve_draft_model
from tidal.gpu.attention import AttentionMetadata, get_attention_backend, kv_quant
from tidal.gpu.cuda_graphs import CudaGraphRunner, graph_rows
from tidal.gpu.distributed import tensor_parallel
from tidal.gpu.draft_vocab import check_compatible
from tidal.gpu.input_batch import CachedRequestState, InputBatch
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.model_loader import LoadOptions, load_model
from tidal.gpu.pipeline import pipeline_stage
from tidal.gpu.spec_step import AttentionRows, rows_as_decode


@dataclass
class DraftStep:
    """What the target's step ran, per request: its computed tokens before the step and how
    many it scheduled; ``sampled``: the requests that got tokens (their state then holds them)."""

    states: list[CachedRequestState]
    starts: list[int]
    counts: list[int]
    sampled: set[str]


@dataclass
class _Rows:
    """One draft forward's requests: their input ids and positions, host side."""

    index: list[int]  # each row-request's place in the step's states
    ids: list[np.ndarray]
    positions: list[np.ndarray]


class DraftRunner:
    """The draft model, its KV cache, and the guesses it makes after each target step."""

    @classmethod
    def for_config(cls, config: EngineConfig, target: ModelConfig, max_model_len: int,
                   dtype: torch.dtype) -> DraftRunner | None:
        """The draft ``config`` asks for (``"method": "draft_model"``), else None."""
        spec = config.speculative_config
        if not isinstance(spec, SpeculativeConfig) or spec.method != "draft_model":
            return None
        if tensor_parallel().world_size > 1 or pipeline_stage().size > 1:
            raise ValueError("a draft model runs on one device only: no tensor or pipeline "
                             "parallelism")
        return cls(config, spec, target, max_model_len, dtype)

    def __init__(self, config: EngineConfig, spec: SpeculativeConfig, target: ModelConfig,
                 max_model_len: int, dtype: torch.dtype) -> None:
        if config.kv_offload_size or config.runner == "pooling":
            raise ValueError("a draft model runs without a KV offload tier and on a "
                             "generating runner only")
        path = resolve_draft_model(spec, config.model)
        self.model_config = ModelConfig.load(path)
        check_compatible(target, self.model_config, config.model, path)
        self.path, self.device, self.dtype = path, config.device, dtype
        self.k = spec.num_speculative_tokens
        self.block_size, self.max_model_len = config.block_size, max_model_len
        # the most tokens one catch-up forward runs: a step's, and each request's new token
        self.max_rows = config.max_num_batched_tokens + config.max_num_seqs
        self.max_blocks = -(-max_model_len // config.block_size)
        self.scratch_per_seq = self.k // config.block_size + 2
        self.num_scratch = config.max_num_seqs * self.scratch_per_seq
        self.max_num_seqs, self.max_num_batched_tokens = (config.max_num_seqs,
                                                          config.max_num_batched_tokens)
        self.backend = backend = get_attention_backend(config.attention_backend, config.device)
        self.cuda_graphs: CudaGraphRunner | None = None
        self.model, self.cpu = load_model(path, self.model_config, LoadOptions(
            backend, max_model_len, dtype, config.device,
            max_rows=config.max_num_batched_tokens, max_seqs=config.max_num_seqs))
        self.kv_caches: list[tuple[torch.Tensor, ...]] = []
        self.num_blocks = 0
        # per block id: the hash of the tokens whose draft KV the block holds, None for none
        self.block_keys = np.full(0, None, dtype=object)

    def bytes_per_token(self, quantized: bool) -> int:
        """The draft's KV bytes per token (all its layers), for the cache's budget."""
        cfg = self.model_config
        return (cfg.kv_bytes_per_token(1, kv_quant.SCALE_BYTES) if quantized
                else cfg.kv_bytes_per_token(self.dtype.itemsize))

    def allocate(self, num_blocks: int, quantized: bool) -> None:
        """The draft's KV: the target's ``num_blocks`` shared block ids, then its scratch."""
        cfg = self.model_config
        shape = (num_blocks + self.num_scratch, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        dtype = torch.int8 if quantized else self.dtype
        self.kv_caches = [kv_quant.allocate_layer(shape, dtype, self.device)
                          for _ in range(cfg.num_layers)]
        self.num_blocks = num_blocks
        self.block_keys = np.full(num_blocks + self.num_scratch, None, dtype=object)

    def capture_cuda_graphs(self) -> None:
        """Graphs of the draft's decode-shaped forwards over its allocated cache (its guesses,
        and a catch-up after a verification as one-token rows), where the target captures its
        own (``gpu/kv_cache_setup.py``): Triton attention and a dense draft."""
        if self.cpu is not None or self.backend.name != "triton" or self.model_config.num_experts:
            return
        rows = graph_rows(self.max_num_seqs, self.k + 2, self.max_num_batched_tokens)
        self.cuda_graphs = CudaGraphRunner(
            lambda ids, pos, meta: self.model(ids, pos, self.kv_caches, meta), rows,
            self.max_blocks + self.scratch_per_seq, self.max_model_len, self.device)
        self.cuda_graphs.capture()

    # -- after a target step ---------------------------------------------------------------
    def note(self, batch: InputBatch, sched: SchedulerOutput) -> DraftedHandle | None:
        """What ``sched`` runs, noted before the runner advances its requests (None for an
        empty step): the draft follows it once its tokens are known."""
        if sched.is_empty or not sched.propose_drafts:
            return None  # a plain step: the draft catches up when one speculates again
        states = [batch.states[r] for r in sched.num_scheduled_tokens]
        return DraftedHandle(self, batch, DraftStep(
            states, [s.num_computed_tokens for s in states],
            list(sched.num_scheduled_tokens.values()), set()))

    def propose(self, batch: InputBatch, step: DraftStep) -> dict[str, list[int]]:
        """Fill the draft's KV for what the target's step computed, and guess ``k`` tokens
        after each sampling request's new last token."""
        table = self._block_table(batch, step)
        catch_up, ends = self._catch_up_rows(batch, step)
        sampling = [i for i, s in enumerate(step.states) if s.req_id in step.sampled]
        if not catch_up.index:
            return {}
        one_call = self._propose_in_one_call(catch_up, table, sampling, ends)
        if one_call is not None:
            self._record_keys(batch, step, catch_up, ends)
            self._forget_guessed(table, sampling, ends)
            return {step.states[i].req_id: g for i, g in zip(sampling, one_call.tolist())}
        first = self._catch_up(catch_up, table, set(sampling))
        self._record_keys(batch, step, catch_up, ends)
        proposals = {step.states[i].req_id: [first[i]] for i in sampling}
        live, last = np.asarray(sampling, dtype=np.int64), np.asarray(ends, dtype=np.int64) - 1
        guesses = np.asarray([first[i] for i in sampling], dtype=np.int64)
        for j in range(1, self.k):
            positions = last[live] + j
            keep = positions < self.max_model_len
            live, positions, guesses = live[keep], positions[keep], guesses[keep]
            if not len(live):
                break
            guesses = self._guess(table[live], guesses, positions)
            for i, g in zip(live.tolist(), guesses.tolist()):
                proposals[step.states[i].req_id].append(g)
        return proposals

    def _propose_in_one_call(self, rows: _Rows, table: np.ndarray, sampling: list[int],
                             ends: list[int]) -> np.ndarray | None:
        """The catch-up ``rows`` and every guess in one call of the CPU's one-call decode
        step (``CpuBackend.propose``), [sampling requests, k], where it takes them: the
        rows in one forward, no request's more than a verification's catch-up (k + 2),
        every guess within the model's length; else None."""
        if self.cpu is None or not sampling:  # on a GPU: nothing to build
            return None
        lens = np.array([len(p) for p in rows.positions], dtype=np.int64)
        if (lens.max() > self.k + 2 or lens.sum() > self.max_rows
                or max(ends[i] for i in sampling) + self.k - 2 >= self.max_model_len):
            return None
        where = {i: j for j, i in enumerate(rows.index)}
        last_rows = np.cumsum(lens)[[where[i] for i in sampling]] - 1
        return self.cpu.propose(
            np.concatenate(rows.ids).astype(np.int64), np.concatenate(rows.positions),
            self.kv_caches, table, np.repeat(np.asarray(rows.index, dtype=np.int64), lens),
            np.asarray(sampling, dtype=np.int64), last_rows, self.model.lm_head, self.k,
            self.block_size)

    def _forget_guessed(self, table: np.ndarray, sampling: list[int], ends: list[int]) -> None:
        """The blocks the guesses after each of ``sampling``'s first wrote hold no known
        tokens' KV alone (as ``_guess`` marks its own)."""
        requests = np.asarray(sampling, dtype=np.int64)
        positions = np.asarray(ends, dtype=np.int64)[requests, None] + np.arange(self.k - 1)
        self.block_keys[table[requests[:, None], positions // self.block_size].ravel()] = None

    def _catch_up_rows(self, batch: InputBatch, step: DraftStep) -> tuple[_Rows, list[int]]:
        """Each request's tokens the target computed and kept this step (and before it, in
        steps the draft did not follow), and a sampling request's new last token; and where
        each request's tokens end."""
        rows = _Rows([], [], [])
        ends = []
        for i, (state, start, count) in enumerate(zip(step.states, step.starts, step.counts)):
            if state.draft_keys is None:  # first followed: what its prefix hit's blocks hold
                state.draft_keys = self._held_keys(batch, state, start)
                state.draft_len = len(state.draft_keys) * self.block_size
            end = state.num_tokens if state.req_id in step.sampled else start + count
            begin, state.draft_len = min(state.draft_len, start), end
            ends.append(end)
            if end > begin:
                rows.index.append(i)
                rows.ids.append(batch.token_ids[state.row, begin:end])
                rows.positions.append(np.arange(begin, end, dtype=np.int64))
        return rows, ends

    def _held_keys(self, batch: InputBatch, state: CachedRequestState,
                   limit: int) -> list[BlockHash]:
        """The keys of ``state``'s leading full blocks (within its first ``limit`` tokens)
        whose draft KV holds its own tokens."""
        keys: list[BlockHash] = []
        for b in range(min(limit // self.block_size, state.num_blocks)):
            key = self._key(batch, state, b, keys[-1] if keys else None)
            if self.block_keys[batch.block_table[state.row, b]] != key:
                break
            keys.append(key)
        return keys

    def _record_keys(self, batch: InputBatch, step: DraftStep, rows: _Rows,
                     ends: list[int]) -> None:
        """Key the blocks the catch-up ``rows`` filled; a block they wrote in part holds no
        whole block's tokens."""
        bs = self.block_size
        for i, positions in zip(rows.index, rows.positions):
            state = step.states[i]
            assert state.draft_keys is not None
            keys = state.draft_keys
            del keys[positions[0] // bs:]  # the blocks these rows wrote again
            full = min(ends[i] // bs, state.num_blocks)
            for b in range(len(keys), full):
                keys.append(self._key(batch, state, b, keys[-1] if keys else None))
                self.block_keys[batch.block_table[state.row, b]] = keys[-1]
            if full < state.num_blocks:
                self.block_keys[batch.block_table[state.row, full]] = None

    def _key(self, batch: InputBatch, state: CachedRequestState, block: int,
             previous: BlockHash | None) -> BlockHash:
        """The hash of the tokens up to the end of ``state``'s ``block`` (``previous``: the
        block before's), as the prefix cache chains them."""
        bs = self.block_size
        tokens = batch.token_ids[state.row, block * bs:(block + 1) * bs]
        return hash_block_tokens(previous, tokens.tolist())

    def _catch_up(self, rows: _Rows, table: np.ndarray, sampling: set[int]) -> dict[int, int]:
        """Run the catch-up ``rows`` in forwards of at most the step's token budget (a draft
        that lagged may have many); the first guess of each request in ``sampling``."""
        pieces = [[(i, ids[j:j + self.max_rows], pos[j:j + self.max_rows])
                   for j in range(0, len(ids), self.max_rows)]
                  for i, ids, pos in zip(rows.index, rows.ids, rows.positions)]
        forwards: list[_Rows] = []
        for round_ in itertools.zip_longest(*pieces):  # a request's pieces in order
            size = self.max_rows
            for i, ids, pos in filter(None, round_):
                if size + len(ids) > self.max_rows:
                    forwards.append(_Rows([], [], []))
                    size = 0
                forwards[-1].index.append(i)
                forwards[-1].ids.append(ids)
                forwards[-1].positions.append(pos)
                size += len(ids)
        ends = {i: pos[-1] for i, pos in zip(rows.index, rows.positions)}
        guesses: dict[int, int] = {}
        for part in forwards:
            last = [j for j, i in enumerate(part.index)
                    if i in sampling and part.positions[j][-1] == ends[i]]
            for j, g in zip(last, self._forward(part, table, last)):
                guesses[part.index[j]] = g
        return guesses

    def _block_table(self, batch: InputBatch, step: DraftStep) -> np.ndarray:
        """The step's requests' block tables, the blocks past each one's own given its
        scratch blocks (``scratch_per_seq`` of them, after the shared ids)."""
        table = np.zeros((len(step.states), self.max_blocks + self.scratch_per_seq),
                         dtype=np.int32)
        for i, state in enumerate(step.states):
            own = min(state.num_blocks, self.max_blocks)
            table[i, :own] = batch.block_table[state.row, :own]
            scratch = self.num_blocks + i * self.scratch_per_seq
            table[i, own:own + self.scratch_per_seq] = np.arange(
                scratch, scratch + self.scratch_per_seq, dtype=np.int32)
        return table

    def _forward(self, rows: _Rows, table: np.ndarray, logit_rows: list[int]) -> list[int]:
        """Run the draft over ``rows``; the greedy next token after the last token of each
        row-request in ``logit_rows``."""
        lens = np.array([len(p) for p in rows.positions], dtype=np.int64)
        cu = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        positions = np.concatenate(rows.positions)
        seq_lens = np.array([p[-1] + 1 for p in rows.positions], dtype=np.int64)
        req_table = table[rows.index]
        token_req = np.repeat(np.arange(len(lens)), lens)
        bs = self.block_size
        slots = req_table[token_req, positions // bs].astype(np.int64) * bs + positions % bs
        as_decode = rows_as_decode(self.device, self.cuda_graphs, int(cu[-1]))
        seen = AttentionRows.of_step(  # a catch-up after a verification: the last known token
            # again (the target computed it this step), its accepted run and its new token
            np.arange(len(lens)), cu, seq_lens, token_req, positions, int(lens.max()),
            turn_up_to=self.k + 2 if as_decode else 0)
        width = -(-int(seq_lens.max()) // bs)
        meta = self._meta(seen.cu, seen.seq_lens, req_table[seen.rows, :width], slots,
                          seen.max_query_len)
        hidden = self._run(np.concatenate(rows.ids).astype(np.int64), positions, meta)
        if not logit_rows:
            return []
        last = self._to_device(cu[1:][np.asarray(logit_rows, dtype=np.int64)] - 1)
        logits = self.model.compute_logits(hidden.index_select(0, last))
        return logits.argmax(dim=-1).tolist()

    def _guess(self, table: np.ndarray, ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """One forward of a token a request, ``ids`` at ``positions`` (``table``: their
        block tables), and each one's greedy next token: ``_forward``'s one-row case, its
        arrays built whole rather than row by row."""
        bs = self.block_size
        blocks = table[np.arange(len(ids)), positions // bs]
        self.block_keys[blocks] = None  # a guess's KV: the block holds no known tokens' alone
        slots = blocks.astype(np.int64) * bs + positions % bs
        seq_lens = positions + 1
        meta = self._meta(np.arange(len(ids) + 1), seq_lens,
                          table[:, : -(-int(seq_lens.max()) // bs)], slots, 1)
        logits = self.model.compute_logits(self._run(ids, positions, meta))
        return np.asarray(logits.argmax(dim=-1).tolist(), dtype=np.int64)

    def _meta(self, cu: np.ndarray, seq_lens: np.ndarray, table: np.ndarray,
              slots: np.ndarray, max_query_len: int) -> AttentionMetadata:
        dev = self._to_device
        return AttentionMetadata(
            num_actual_tokens=len(slots), query_start_loc=dev(cu.astype(np.int32)),
            seq_lens=dev(seq_lens.astype(np.int32)), block_table=dev(table),
            slot_mapping=dev(slots), max_query_len=max_query_len,
            max_seq_len=int(seq_lens.max()), query_start_loc_cpu=cu.tolist(),
            seq_lens_cpu=seq_lens.tolist())

    def _run(self, ids: np.ndarray, positions: np.ndarray,
             meta: AttentionMetadata) -> torch.Tensor:
        """The draft's hidden states: the CPU's one-call decode step where it takes the
        step, a captured CUDA graph where one does, else the model's forward."""
        ids_dev, pos_dev = self._to_device(ids), self._to_device(positions)
        hidden = self.cpu.forward(ids_dev, pos_dev, self.kv_caches, meta) if self.cpu else None
        if hidden is None and self.cuda_graphs is not None and self.cuda_graphs.can_run(meta):
            hidden = self.cuda_graphs.run(ids_dev, pos_dev, meta)
        elif hidden is None:
            hidden = self.model(ids_dev, pos_dev, self.kv_caches, meta)
        return hidden

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        return tensor if self.device == "cpu" else tensor.to(self.device, non_blocking=True)


class DraftedHandle:
    """A target step whose result carries the draft's proposals: the draft runs once the
    target's tokens are on the host (in the runner's thread modes)."""

    def __init__(self, drafter: DraftRunner, batch: InputBatch, step: DraftStep) -> None:
        self.drafter, self.batch, self.step = drafter, batch, step
        self.handle: Any = None
        self.modes: Callable[[], contextlib.AbstractContextManager[None]] | None = None

    def after(self, handle: Any, modes: Callable[[], contextlib.AbstractContextManager[None]]
              ) -> DraftedHandle:
        """Follow the launched target step ``handle``."""
        self.handle, self.modes = handle, modes
        return self

    def result(self) -> ModelRunnerOutput:
        out = self.handle.result()
        self.step.sampled = {s.req_id for s in self.handle.states}
        assert self.modes is not None
        with self.modes():
            out.draft_token_ids = self.drafter.propose(self.batch, self.step)
        return out
