"""What the sampler needs to know about the rows of a step, gathered on the host and sent to
the device in two copies (one float, one int64) however many features the rows use.

A batch whose rows are all greedy with no penalty, bias or min_tokens constraint gets a
metadata object holding no tensor at all: the sampler's fast path is a plain argmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from tidal.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tidal.gpu.input_batch import CachedRequestState, InputBatch


@dataclass(frozen=True)
class RowSampling:
    """One request's sampling parameters in the shape the metadata builder wants them;
    computed once per request and kept on its batch state."""

    greedy: bool
    temperature: float
    top_p: float
    top_k: int  # 0: disabled
    min_p: float
    presence: float
    frequency: float
    repetition: float
    bias_tokens: np.ndarray  # int64, inside the vocabulary
    bias_values: np.ndarray  # float32
    min_tokens: int
    min_tokens_stop_ids: np.ndarray  # int64: stop_token_ids, and EOS unless ignore_eos
    logprobs: int | None

    @property
    def penalised(self) -> bool:
        return self.presence != 0.0 or self.frequency != 0.0 or self.repetition != 1.0

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that edits the logits (min_tokens is checked per step)."""
        return self.greedy and not self.penalised and not self.bias_tokens.size


def row_sampling(params: SamplingParams, eos_token_id: int | None,
                 vocab_size: int) -> RowSampling:
    bias = {int(t): float(v) for t, v in (params.logit_bias or {}).items()
            if 0 <= int(t) < vocab_size and v != 0.0}
    stop_ids = set(params.stop_token_ids)
    if eos_token_id is not None and not params.ignore_eos:
        stop_ids.add(eos_token_id)
    stop_ids = sorted(t for t in stop_ids if 0 <= t < vocab_size)
    top_k = params.top_k if 0 < params.top_k < vocab_size else 0
    return RowSampling(
        greedy=params.greedy, temperature=params.temperature, top_p=params.top_p,
        top_k=top_k, min_p=params.min_p, presence=params.presence_penalty,
        frequency=params.frequency_penalty, repetition=params.repetition_penalty,
        bias_tokens=np.fromiter(bias.keys(), dtype=np.int64, count=len(bias)),
        bias_values=np.fromiter(bias.values(), dtype=np.float32, count=len(bias)),
        min_tokens=params.min_tokens if stop_ids else 0,
        min_tokens_stop_ids=np.asarray(stop_ids, dtype=np.int64),
        logprobs=None if params.logprobs is None else min(params.logprobs, vocab_size))


def needs_metadata(params: SamplingParams) -> bool:
    """Whether a request's rows may need more than a plain argmax: sampling, penalties,
    logit bias, min_tokens or logprobs. (False is exact; True may still build none.)"""
    return not (params.greedy and params.presence_penalty == 0.0
                and params.frequency_penalty == 0.0 and params.repetition_penalty == 1.0
                and not params.logit_bias and params.min_tokens == 0
                and params.logprobs is None)


@dataclass
class Penalties:
    """Penalty data for the subset of rows that asked for a penalty.

    ``rows`` index the batch; every other index here is local to the subset. Output tokens
    still on the device (sampled by the step in flight) come as ``pending_rows`` and
    ``pending_tokens``.
    """

    rows: torch.Tensor  # [P]
    presence: torch.Tensor  # [P]
    frequency: torch.Tensor  # [P]
    repetition: torch.Tensor | None  # [P]; None when no row has a repetition penalty
    prompt_rows: torch.Tensor
    prompt_tokens: torch.Tensor
    output_rows: torch.Tensor
    output_tokens: torch.Tensor
    pending_rows: torch.Tensor | None = None
    pending_tokens: torch.Tensor | None = None
    all_rows: bool = False  # the subset is the whole batch, in order


@dataclass
class RandomRows:
    """The rows that sample (temperature >= 1e-5), with their per-row parameters."""

    rows: torch.Tensor  # [R] batch indices
    temperature: torch.Tensor  # [R]
    top_k: torch.Tensor | None  # [R] long, 0 where disabled; None: nobody uses it
    top_p: torch.Tensor | None  # [R]; None: nobody uses it
    min_p: torch.Tensor | None  # [R]; None: nobody uses it
    max_top_k: int = 0
    all_top_k: bool = False  # every row has a top-k
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # local row -> gen
    all_rows: bool = False


@dataclass
class SamplingMetadata:
    num_rows: int
    max_num_logprobs: int | None  # the largest top-N asked for; None: nobody asked
    random: RandomRows | None = None  # None: every row is greedy
    penalties: Penalties | None = None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, tokens, values
    min_tokens: tuple[torch.Tensor, torch.Tensor] | None = None  # rows, tokens to mask

    @property
    def plain_greedy(self) -> bool:
        return (self.random is None and self.penalties is None and self.bias is None
                and self.min_tokens is None)

    @property
    def all_random(self) -> bool:
        return self.random is not None and self.random.all_rows


def build_sampling_metadata(batch: InputBatch, states: list[CachedRequestState],
                            vocab_size: int, device: torch.device | str,
                            in_flight: tuple[torch.Tensor, dict[str, int]] | None = None,
                            ) -> SamplingMetadata:
    """Metadata for the rows ``states`` (one per logits row, in order).

    ``in_flight`` is the step still running: its sampled ids (on the device) and each
    request's row in them; penalties count those tokens without waiting for them.
    """
    if not batch.num_needing_metadata:  # every row of the batch is a plain argmax
        return SamplingMetadata(len(states), None)
    rows = [_sampling_of(s, vocab_size) for s in states]
    asked = [r.logprobs for r in rows if r.logprobs is not None]
    meta = SamplingMetadata(len(states), max(asked) if asked else None)
    min_tokens_rows = [i for i, (s, r) in enumerate(zip(states, rows))
                       if r.min_tokens and s.num_outputs < r.min_tokens]
    if not min_tokens_rows and all(r.plain_greedy for r in rows):
        return meta
    pack = _Packer()
    random_slots = _pack_random(pack, rows)
    penalty_slots = _pack_penalties(pack, batch, states, rows, in_flight)
    bias_slots = _pack_bias(pack, rows)
    min_tokens_slots = _pack_min_tokens(pack, rows, min_tokens_rows)
    t = pack.to(device)
    if random_slots is not None:
        meta.random = _random_rows(t, random_slots, states, rows)
    if penalty_slots is not None:
        meta.penalties = _penalties(t, penalty_slots, len(states), in_flight)
    if bias_slots is not None:
        meta.bias = (t.ints(bias_slots[0]), t.ints(bias_slots[1]), t.floats(bias_slots[2]))
    if min_tokens_slots is not None:
        meta.min_tokens = (t.ints(min_tokens_slots[0]), t.ints(min_tokens_slots[1]))
    return meta


def _sampling_of(state: CachedRequestState, vocab_size: int) -> RowSampling:
    if state.sampling is None:
        state.sampling = row_sampling(state.params, state.eos_token_id, vocab_size)
    return state.sampling


# -- packing: every host array goes into one float and one int64 buffer ------------------

class _Packer:
    def __init__(self) -> None:
        self._floats: list[np.ndarray] = []
        self._ints: list[np.ndarray] = []
        self._nf = 0
        self._ni = 0

    def float(self, values: np.ndarray | list[float]) -> slice:
        a = np.asarray(values, dtype=np.float32).reshape(-1)
        self._floats.append(a)
        self._nf += a.size
        return slice(self._nf - a.size, self._nf)

    def int(self, values: np.ndarray | list[int]) -> slice:
        a = np.asarray(values, dtype=np.int64).reshape(-1)
        self._ints.append(a)
        self._ni += a.size
        return slice(self._ni - a.size, self._ni)

    def to(self, device: torch.device | str) -> _Packed:
        floats = np.concatenate(self._floats) if self._floats else np.empty(0, np.float32)
        ints = np.concatenate(self._ints) if self._ints else np.empty(0, np.int64)
        return _Packed(torch.from_numpy(floats).to(device, non_blocking=True),
                       torch.from_numpy(ints).to(device, non_blocking=True))


@dataclass
class _Packed:
    f: torch.Tensor
    i: torch.Tensor

    def floats(self, s: slice) -> torch.Tensor:
        return self.f[s]

    def ints(self, s: slice) -> torch.Tensor:
        return self.i[s]


@dataclass
class _RandomSlots:
    local: list[int]  # batch index of each random row
    rows: slice
    params: slice  # temperature, top_k, top_p, min_p: R values each
    max_top_k: int
    all_top_k: bool
    use_top_p: bool
    use_min_p: bool


def _pack_random(pack: _Packer, rows: list[RowSampling]) -> _RandomSlots | None:
    local = [i for i, r in enumerate(rows) if not r.greedy]
    if not local:
        return None
    chosen = [rows[i] for i in local]
    params = np.array([[r.temperature, r.top_k, r.top_p, r.min_p] for r in chosen],
                      dtype=np.float32).T
    return _RandomSlots(
        local=local, rows=pack.int(local), params=pack.float(params),
        max_top_k=max(r.top_k for r in chosen), all_top_k=all(r.top_k for r in chosen),
        use_top_p=any(r.top_p < 1.0 for r in chosen),
        use_min_p=any(r.min_p > 0.0 for r in chosen))


def _random_rows(t: _Packed, s: _RandomSlots, states: list[CachedRequestState],
                 rows: list[RowSampling]) -> RandomRows:
    n = len(s.local)
    params = t.floats(s.params).view(4, n)
    top_k = params[1].long() if s.max_top_k else None
    generators = {j: states[i].generator for j, i in enumerate(s.local)
                  if states[i].generator is not None}
    return RandomRows(
        rows=t.ints(s.rows), temperature=params[0], top_k=top_k,
        top_p=params[2] if s.use_top_p else None, min_p=params[3] if s.use_min_p else None,
        max_top_k=s.max_top_k, all_top_k=s.all_top_k, generators=generators,
        all_rows=n == len(rows))


@dataclass
class _PenaltySlots:
    rows: slice
    params: slice  # presence, frequency, repetition: P values each
    use_repetition: bool
    prompt: tuple[slice, slice]
    output: tuple[slice, slice]
    pending: tuple[slice, slice] | None
    all_rows: bool


def _pack_penalties(pack: _Packer, batch: InputBatch, states: list[CachedRequestState],
                    rows: list[RowSampling],
                    in_flight: tuple[torch.Tensor, dict[str, int]] | None,
                    ) -> _PenaltySlots | None:
    chosen = [i for i, r in enumerate(rows) if r.penalised]
    if not chosen:
        return None
    use_repetition = any(rows[i].repetition != 1.0 for i in chosen)
    prompt_rows, prompt_tokens, output_rows, output_tokens = [], [], [], []
    pending_rows, pending_src = [], []
    for j, i in enumerate(chosen):
        state = states[i]
        known = batch.token_ids[state.row, :state.num_tokens]
        if use_repetition:
            prompt_tokens.append(known[:state.num_prompt_tokens])
            prompt_rows.append(np.full(state.num_prompt_tokens, j, dtype=np.int64))
        outputs = known[state.num_prompt_tokens:]
        output_tokens.append(outputs)
        output_rows.append(np.full(outputs.size, j, dtype=np.int64))
        if state.num_pending and in_flight is not None and state.req_id in in_flight[1]:
            pending_rows.append(j)
            pending_src.append(in_flight[1][state.req_id])
    params = np.array([[rows[i].presence, rows[i].frequency, rows[i].repetition]
                       for i in chosen], dtype=np.float32).T
    pending = None
    if pending_rows:
        pending = (pack.int(pending_rows), pack.int(pending_src))
    return _PenaltySlots(
        rows=pack.int(chosen), params=pack.float(params), use_repetition=use_repetition,
        prompt=(pack.int(_cat(prompt_rows)), pack.int(_cat(prompt_tokens))),
        output=(pack.int(_cat(output_rows)), pack.int(_cat(output_tokens))),
        pending=pending, all_rows=len(chosen) == len(states))


def _penalties(t: _Packed, s: _PenaltySlots, num_rows: int,
               in_flight: tuple[torch.Tensor, dict[str, int]] | None) -> Penalties:
    p = s.rows.stop - s.rows.start
    params = t.floats(s.params).view(3, p)
    out = Penalties(
        rows=t.ints(s.rows), presence=params[0], frequency=params[1],
        repetition=params[2] if s.use_repetition else None,
        prompt_rows=t.ints(s.prompt[0]), prompt_tokens=t.ints(s.prompt[1]),
        output_rows=t.ints(s.output[0]), output_tokens=t.ints(s.output[1]),
        all_rows=s.all_rows)
    if s.pending is not None and in_flight is not None:
        out.pending_rows = t.ints(s.pending[0])
        out.pending_tokens = in_flight[0][t.ints(s.pending[1])]
    return out


def _pack_bias(pack: _Packer, rows: list[RowSampling]) -> tuple[slice, slice, slice] | None:
    chosen = [i for i, r in enumerate(rows) if r.bias_tokens.size]
    if not chosen:
        return None
    return (pack.int(np.concatenate([np.full(rows[i].bias_tokens.size, i, dtype=np.int64)
                                     for i in chosen])),
            pack.int(_cat([rows[i].bias_tokens for i in chosen])),
            pack.float(np.concatenate([rows[i].bias_values for i in chosen])))


def _pack_min_tokens(pack: _Packer, rows: list[RowSampling],
                     chosen: list[int]) -> tuple[slice, slice] | None:
    if not chosen:
        return None
    ids = [rows[i].min_tokens_stop_ids for i in chosen]
    return (pack.int(np.concatenate([np.full(a.size, i, dtype=np.int64)
                                     for i, a in zip(chosen, ids)])),
            pack.int(_cat(ids)))


def _cat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64)
