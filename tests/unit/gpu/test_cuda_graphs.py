"""Decode CUDA graphs: capture sizes, and the replay path's static buffers and padding.

Without a GPU the graph is emulated: "replay" reruns the captured forward eagerly on the
static buffers with the capture-time metadata, which is what a real replay computes. That checks
everything but the capture itself: inputs copied into the right buffers, padded requests reading
and writing nothing, and the backend taking lengths from device tensors only.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.device import KERNEL_TEST_DEVICE  # noqa: E402
from tidal.core import LLM, SamplingParams  # noqa: E402
from tidal.gpu.attention import AttentionMetadata  # noqa: E402
from tidal.gpu.cuda_graphs import CudaGraphRunner, capture_sizes  # noqa: E402
from tidal.gpu.random_model import build_model_dir  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = KERNEL_TEST_DEVICE


@pytest.mark.parametrize("max_num_seqs,expected", [
    (1, [1]), (3, [1, 2, 4]), (5, [1, 2, 4, 8]), (8, [1, 2, 4, 8]), (9, [1, 2, 4, 8, 16]),
    (20, [1, 2, 4, 8, 16, 32]), (64, [1, 2, 4, 8, 16, 32, 48, 64]),
])
def test_capture_sizes(max_num_seqs, expected):
    assert capture_sizes(max_num_seqs) == expected


def test_capture_sizes_cover_every_batch_in_steps_of_16():
    sizes = capture_sizes(256)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 256
    assert all(b - a == 16 for a, b in zip(sizes[4:], sizes[5:]))


class _CountedReplay:
    """A graph stand-in that counts its replays; ``run`` does the replay's work."""

    def __init__(self, run) -> None:
        self.run = run
        self.count = 0

    def replay(self) -> None:
        self.count += 1
        self.run()


class EmulatedGraphRunner(CudaGraphRunner):
    """Replays by rerunning the forward on the static buffers and capture-time metadata."""

    def _capture_one(self, size: int, meta: AttentionMetadata):
        ids, positions = self.input_ids[:size], self.positions[:size]
        out = self.forward(ids, positions, meta)
        return _CountedReplay(lambda: out.copy_(self.forward(ids, positions, meta))), out


def _echo(input_ids: torch.Tensor, positions: torch.Tensor,
          meta: AttentionMetadata) -> torch.Tensor:
    """A stand-in model whose hidden state per row shows what that row was fed."""
    assert meta.is_decode_only and meta.max_seq_len == 100
    return torch.stack([input_ids, positions, meta.seq_lens.long(), meta.slot_mapping,
                        meta.block_table[:, :2].long().sum(1)], 1).float()


def _decode_meta(seq_lens: list[int], slots: list[int], table: list[list[int]]):
    n = len(seq_lens)
    with torch.device(DEVICE):
        return AttentionMetadata(
            num_actual_tokens=n, query_start_loc=torch.arange(n + 1, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=torch.tensor(table, dtype=torch.int32), slot_mapping=torch.tensor(slots),
            max_query_len=1, max_seq_len=max(seq_lens), query_start_loc_cpu=list(range(n + 1)),
            seq_lens_cpu=seq_lens)


def test_run_pads_to_the_next_size_with_empty_requests():
    graphs = EmulatedGraphRunner(_echo, 8, 4, max_model_len=100, device=DEVICE)
    graphs.capture()
    assert sorted(graphs.graphs) == [1, 2, 4, 8]
    big = _decode_meta([9, 9, 9, 9, 9], [1, 2, 3, 4, 5], [[1, 2]] * 5)
    meta = _decode_meta([5, 40, 17], [4, 39, 16], [[3, 1], [2, 4], [5, 6]])
    with torch.inference_mode(), torch.device(DEVICE):  # as the model runner calls it
        graphs.run(torch.arange(5), torch.arange(5), big)  # leaves rows 3 and 4 behind
        out = graphs.run(torch.tensor([11, 12, 13]), torch.tensor([4, 39, 16]), meta)
    assert out.tolist() == [[11, 4, 5, 4, 4], [12, 39, 40, 39, 6], [13, 16, 17, 16, 11]]
    assert graphs.graphs[4].count == 1 and graphs.graphs[8].count == 1
    padded = graphs.outputs[4][3]  # the padded request: no context, no slot
    assert padded[2].item() == 0 and padded[3].item() == -1
    assert not graphs.can_run(_decode_meta([1] * 9, [0] * 9, [[0]] * 9))


@pytest.mark.slow
def test_graph_replay_gives_the_eager_tokens(tmp_path):
    """Four requests finishing one after another: decode batches of 4, 3, 2, 1 replay the
    graphs of 4, 4, 2, 1 with padded requests; tokens equal the torch backend's."""
    path = str(build_model_dir(tmp_path / "llama", "llama"))
    prompts = [[7 + i for i in range(n)] for n in (3, 17, 33, 50)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in (3, 5, 7, 9)]
    on = {"device": DEVICE, "dtype": "float32", "kv_cache_memory": 64 << 20}
    expected = LLM(path, attention_backend="torch", **on).generate(prompts, params,
                                                                   use_tqdm=False)
    llm = LLM(path, attention_backend="triton", max_num_seqs=8, enforce_eager=True, **on)
    runner = llm.engine.executor.runner
    graphs = EmulatedGraphRunner(runner.run_model, 8, runner.max_blocks_per_req,
                                 runner.max_model_len, runner.device)
    graphs.capture()
    runner.cuda_graphs = graphs
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    replays = {size: g.count for size, g in graphs.graphs.items()}
    assert replays[4] >= 2 and replays[2] >= 1 and replays[1] >= 1 and replays[8] == 0


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="captures real CUDA graphs")
def test_real_cuda_graphs_give_the_eager_tokens(tmp_path):
    """On a GPU: the engine's captured decode graphs replay to the tokens and logprobs of an
    eager run, across batch sizes that shrink as requests finish."""
    path = str(build_model_dir(tmp_path / "llama", "llama"))
    prompts = [[7 + i for i in range(n)] for n in (3, 17, 33, 50, 90)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=2)
              for m in (3, 9, 17, 25, 40)]
    common = {"device": DEVICE, "dtype": "float32", "kv_cache_memory": 64 << 20}
    expected = LLM(path, enforce_eager=True, **common).generate(prompts, params,
                                                                use_tqdm=False)
    llm = LLM(path, max_num_seqs=8, **common)
    graphs = llm.engine.executor.runner.cuda_graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8]
    graphs.graphs = {size: _CountedReplay(g.replay) for size, g in graphs.graphs.items()}
    got = llm.generate(prompts, params, use_tqdm=False)
    replays = {size: g.count for size, g in graphs.graphs.items()}
    assert replays[8] >= 2 and replays[1] >= 10 and sum(replays.values()) >= 38, replays
    for ours, ref in zip(got, expected):
        assert ours.outputs[0].token_ids == ref.outputs[0].token_ids
        for mine, theirs in zip(ours.outputs[0].logprobs, ref.outputs[0].logprobs):
            assert mine.keys() == theirs.keys()
            assert all(abs(mine[t] - theirs[t]) < 1e-4 for t in mine)
