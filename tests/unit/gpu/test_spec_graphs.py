"""Speculative steps under CUDA graphs: a step that verifies proposals runs each of them as a
one-token row of its own, so it replays the decode graphs (captured up to ``k + 1`` rows a
request); a draft model replays graphs of its own for its guesses and catch-ups.

Without a GPU the graphs are emulated as in ``test_cuda_graphs.py`` (a replay reruns the
captured forward on the static buffers, Triton's kernels in its interpreter); on a GPU the
engine's own captured graphs run, counted.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.device import KERNEL_TEST_DEVICE  # noqa: E402
from tests.unit.gpu.test_cuda_graphs import EmulatedGraphRunner, _CountedReplay  # noqa: E402
from tests.unit.gpu.test_draft_model import pair  # noqa: E402,F401 - a fixture
from tests.unit.gpu.test_spec_decode import speculating  # noqa: E402
from tidal.core import LLM, SamplingParams  # noqa: E402
from tidal.gpu.cuda_graphs import MAX_SPEC_ROWS, CudaGraphRunner, graph_rows  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = KERNEL_TEST_DEVICE
K = 4
SPECS = {"ngram": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
                   "prompt_lookup_max": 3}}


def test_graph_rows_reach_every_requests_proposals_within_their_bounds():
    assert graph_rows(8, 1, 2048) == 8  # no speculation: a row a request
    assert graph_rows(8, K + 1, 2048) == 40
    assert graph_rows(256, K + 1, 2048) == MAX_SPEC_ROWS
    assert graph_rows(64, K + 1, 128) == 128  # within the step's token budget
    assert graph_rows(256, K + 1, 128) == 256  # never below a row a request


def _counted_graphs(llm: LLM) -> list[CudaGraphRunner]:
    """The target's graphs and the draft's (if any), each replay counted: on a GPU the
    engine's captured ones, on the CPU emulated ones put in their place."""
    runner = llm.engine.executor.runner
    drafter = runner.drafter
    if DEVICE == "cpu":
        rows = graph_rows(runner.config.max_num_seqs, K + 1,
                          runner.config.max_num_batched_tokens)
        runner.cuda_graphs = EmulatedGraphRunner(runner.run_model, rows,
                                                 runner.max_blocks_per_req,
                                                 runner.max_model_len, runner.device)
        if drafter is not None:
            drafter.cpu = None  # the model's forward, as on a GPU, not the CPU's decode step
            drafter.cuda_graphs = EmulatedGraphRunner(
                lambda ids, pos, meta: drafter.model(ids, pos, drafter.kv_caches, meta),
                graph_rows(drafter.max_num_seqs, K + 2, drafter.max_num_batched_tokens),
                drafter.max_blocks + drafter.scratch_per_seq, drafter.max_model_len,
                drafter.device)
        graphs = [runner.cuda_graphs] + ([drafter.cuda_graphs] if drafter else [])
        for g in graphs:
            g.capture()
        return graphs
    graphs = [runner.cuda_graphs] + ([drafter.cuda_graphs] if drafter else [])
    assert all(g is not None for g in graphs)
    for g in graphs:
        g.graphs = {size: _CountedReplay(graph.replay) for size, graph in g.graphs.items()}
    return graphs


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculating_steps_replay_graphs_and_keep_the_tokens(pair, method):  # noqa: F811
    """Greedy tokens and logprobs with proposals verified in replayed graphs equal those of
    an eager run without speculation; the verifying steps (more rows than requests) and,
    with a draft (the target itself: every proposal accepted), its forwards replay graphs."""
    on = {"device": DEVICE, "dtype": "float32", "kv_cache_memory": 64 << 20,
          "max_num_seqs": 4, "max_num_batched_tokens": 64}
    prompts = [[7 + i % 5 for i in range(n)] for n in (9, 17, 30)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=2)
              for m in (12, 20, 9)]
    want = LLM(pair["target"], enforce_eager=True, **on).generate(prompts, params,
                                                                 use_tqdm=False)
    spec = (SPECS["ngram"] if method == "ngram" else
            {"method": "draft_model", "model": pair["target"], "num_speculative_tokens": K})
    attention = {"attention_backend": "triton", "enforce_eager": True} if DEVICE == "cpu" else {}
    llm = speculating(LLM(pair["target"], speculative_config=spec, **attention, **on))
    graphs = _counted_graphs(llm)
    got = llm.generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for got_lp, want_lp in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert got_lp.keys() == want_lp.keys()
            for token, value in want_lp.items():
                assert got_lp[token] == pytest.approx(value, abs=1e-4)
    stats = llm.engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    if method == "draft_model":  # the target as its draft
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    target = {size: g.count for size, g in graphs[0].graphs.items()}
    assert sum(n for size, n in target.items() if size > 4) > 0, target  # k + 1 rows a request
    if method == "draft_model":
        assert sum(g.count for g in graphs[1].graphs.values()) > 0
