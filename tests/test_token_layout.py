"""``TokenLayout``: where a step's tokens sit, on the decode-only path and the general one."""

from __future__ import annotations

import numpy as np

from core.scheduler_output import SchedulerOutput
from gpu.model_runner import TokenLayout


def _sched(num_scheduled: dict[str, int]) -> SchedulerOutput:
    return SchedulerOutput([], [], num_scheduled, sum(num_scheduled.values()))


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
