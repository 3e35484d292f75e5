"""``TokenLayout``: where a step's tokens sit, on the decode-only path and the general one;
and the CPU kernels' decode inputs against the runner's general numpy path."""

from __future__ import annotations

import numpy as np
import torch

from tidal.core import LLM, SamplingParams
from tidal.core.scheduler_output import SchedulerOutput
from tidal.gpu.random_model import build_model_dir
from tidal.gpu.step_inputs import StepInputs, TokenLayout


def _sched(num_scheduled: dict[str, int]) -> SchedulerOutput:
    return SchedulerOutput([], {}, num_scheduled, sum(num_scheduled.values()))


def test_a_mixed_step_lays_out_each_requests_chunk_after_its_computed_tokens():
    layout = TokenLayout.of(_sched({"a": 3, "b": 1, "c": 2}), np.array([5, 9, 0]))
    assert layout.cu.tolist() == [0, 3, 4, 6]
    assert layout.positions.tolist() == [5, 6, 7, 9, 0, 1]
    assert layout.seq_lens.tolist() == [8, 10, 2]
    assert layout.max_query_len == 3
    assert layout.per_token(np.array([10, 20, 30])).tolist() == [10, 10, 10, 20, 30, 30]
    assert layout.request_of(np.array([2, 3, 5])).tolist() == [0, 1, 2]


def test_a_decode_only_step_matches_the_general_layout():
    computed = np.array([4, 17, 8])
    decode = TokenLayout.of(_sched({"a": 1, "b": 1, "c": 1}), computed)
    assert decode.req_of_token is None  # the shortcut was taken
    # the general path, forced by a second step over the same requests with one more token
    general = TokenLayout.of(_sched({"a": 1, "b": 1, "c": 1, "d": 2}),
                             np.append(computed, 0))
    assert decode.cu.tolist() == general.cu[:4].tolist()
    assert decode.positions.tolist() == general.positions[:3].tolist()
    assert decode.seq_lens.tolist() == general.seq_lens[:3].tolist()
    assert decode.max_query_len == 1
    rows = np.array([7, 3, 5])
    assert decode.per_token(rows).tolist() == rows.tolist()
    assert decode.request_of(np.array([0, 2])).tolist() == [0, 2]


def _assert_same_inputs(general: StepInputs, fast: StepInputs) -> None:
    for name in ("input_ids", "positions"):
        a, b = getattr(general, name), getattr(fast, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
        a, b = getattr(general.meta, name), getattr(fast.meta, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for name in ("num_actual_tokens", "max_query_len", "max_seq_len", "query_start_loc_cpu",
                 "seq_lens_cpu"):
        assert getattr(general.meta, name) == getattr(fast.meta, name), name
    assert general.logits_indices is None and fast.logits_indices is None
    assert general.sampling_states == fast.sampling_states


def test_the_cpu_decode_path_builds_the_general_paths_inputs(tmp_path):
    """Every decode step's inputs, built by the kernels' ``decode_inputs`` and by the numpy
    path, over prompts whose decodes cross block boundaries and requests that finish."""
    llm = LLM(str(build_model_dir(tmp_path / "llama", "llama")), max_num_seqs=4)
    engine, runner = llm.engine, llm.engine.executor.runner
    assert runner._decode_inputs is not None
    prepare, decode_inputs, pairs = runner._prepare_inputs, runner._decode_inputs, []

    def both(sched: SchedulerOutput) -> StepInputs:
        states = [runner.batch.states[r] for r in sched.num_scheduled_tokens]
        computed = [s.num_computed_tokens for s in states]
        runner._decode_inputs = None
        general = prepare(sched)
        for state, n in zip(states, computed):
            state.num_computed_tokens = n
        runner._decode_inputs = decode_inputs
        fast = prepare(sched)
        if sched.total_num_scheduled_tokens == len(states):
            pairs.append((general, fast))
        return fast

    runner._prepare_inputs = both
    for i, (n, out) in enumerate(((5, 40), (17, 12), (33, 30), (2, 50))):
        engine.add_request(f"r{i}", list(range(10, 10 + n)),
                           SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True))
    with engine.step_modes():
        while engine.has_unfinished_requests():
            engine.step()
    assert len(pairs) >= 45
    for general, fast in pairs:
        _assert_same_inputs(general, fast)

