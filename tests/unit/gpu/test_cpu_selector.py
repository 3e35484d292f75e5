"""The CPU op selector: it keeps the fastest candidate per row bucket from the timings it is
given, caches its plans per host (never reusing another CPU's or torch's), sets them on the
model, and every candidate it can choose gives the torch reference's results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tidal.gpu.attention import get_attention_backend
from tidal.gpu.cpu import op_plans, selector
from tidal.gpu.cpu.kernels import load_cpu_kernels
from tidal.gpu.cpu.selector import KERNELS, TORCH, Plan, PlanCache, choose, row_buckets

needs_kernels = pytest.mark.skipif(load_cpu_kernels() is None, reason="needs the C++ kernels")


def fake_timer(costs: dict[str, float]):
    """A timer whose every call of a candidate takes ``costs[name]`` ms."""
    return lambda name, fn, calls: costs[name]


def named(rows: int, names: list[str]) -> dict:
    return {name: (lambda n=name: n) for name in names}


def test_row_buckets_are_powers_of_two_up_to_the_most_rows() -> None:
    assert row_buckets(1) == [1]
    assert row_buckets(192) == [1, 2, 4, 8, 16, 32, 64, 128, 192]
    assert row_buckets(64) == [1, 2, 4, 8, 16, 32, 64]


def scripted(by_rows: dict[int, dict[str, float]]):
    """Candidates and a timer for ``choose`` under which each candidate's call takes
    ``by_rows[rows][name]`` ms."""
    now: dict[str, float] = {}

    def candidates(rows: int) -> dict:
        now.clear()
        now.update(by_rows[rows])
        return named(rows, list(now))

    return candidates, lambda name, fn, calls: now[name]


def test_choose_keeps_the_fastest_candidate_of_each_bucket() -> None:
    candidates, timer = scripted({1: {"a": 1.0, "b": 2.0, "torch": 3.0},
                                  2: {"a": 1.0, "b": 0.5, "torch": 3.0},
                                  4: {"a": 9.0, "b": 8.0, "torch": 2.0}})
    plan = choose([1, 2, 4], candidates, timer=timer)
    assert plan.choices == ("a", "b", "torch")
    assert [plan.pick(r) for r in range(1, 9)] == ["a", "b", "torch", "torch", "torch", "torch",
                                                   "torch", "torch"]
    assert plan.timings[2]["torch"] == 2.0
    assert plan.describe() == "a 1, b 2, torch 3+ rows"


def test_choose_keeps_few_layouts_when_the_others_win_by_noise() -> None:
    """"b" wins the middle bucket by 3 %, within the margin, so "a" alone serves every bucket
    (each layout kept is another packed copy of the weight); a win by more keeps "b"."""
    candidates, timer = scripted({1: {"a": 1.0, "b": 2.0}, 2: {"a": 1.0, "b": 0.97},
                                  4: {"a": 1.0, "b": 3.0}})
    assert choose([1, 2, 4], candidates, timer=timer).choices == ("a", "a", "a")
    candidates, timer = scripted({1: {"a": 1.0, "b": 2.0}, 2: {"a": 1.0, "b": 0.8},
                                  4: {"a": 1.0, "b": 3.0}})
    assert choose([1, 2, 4], candidates, timer=timer).choices == ("a", "b", "a")
    assert selector.fewest_within([{"a": 1.0, "b": 0.5}], 0.05) == {"b"}
    assert selector.fewest_within([{"a": 1.0, "b": 0.97}, {"a": 1.0, "b": 1.2}], 0.05) == {"a"}


def noisy(by_rows: dict[int, dict[str, float]], noise: float, seed: int):
    """``scripted``, but each round of calls takes up to ``noise`` (a fraction) longer, at
    random: a co-tenant that comes and goes."""
    import random

    rng = random.Random(seed)
    candidates, exact = scripted(by_rows)
    return candidates, lambda name, fn, calls: exact(name, fn, calls) * (
        1 + noise * rng.random() ** 2)


BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128]
# "a" wins the small buckets and "b" the large ones by 3x; in between they are within a few
# percent of each other.
SPLIT = {rows: {"a": 1.0, "b": 3.0} if rows <= 8 else {"a": 1.0, "b": 0.97} if rows <= 32
         else {"a": 3.0, "b": 1.0} for rows in BUCKETS}
CLOSE = {rows: {"a": 1.0 + 0.04 * (rows % 3), "b": 1.02 + 0.03 * (rows % 2),
                "torch": 1.05} for rows in BUCKETS}


@pytest.mark.parametrize("seed", range(5))
def test_noise_cannot_make_a_patchwork(seed: int) -> None:
    """Candidates within the noise of each other: one layout serves every bucket, however
    the noise falls; a plan timed that noisily says so (provisional)."""
    plan = choose(BUCKETS, *noisy(CLOSE, 0.5, seed))
    assert len(plan.used()) == 1, plan.describe()
    assert plan.provisional and plan.noise > selector.NOISY
    quiet = choose(BUCKETS, *scripted(CLOSE))
    assert quiet.noise == 0.0 and not quiet.provisional


@pytest.mark.parametrize("seed", range(5))
def test_noise_keeps_every_choice_won_by_more_than_the_noise(seed: int) -> None:
    quiet = choose(BUCKETS, *scripted(SPLIT))
    plan = choose(BUCKETS, *noisy(SPLIT, 0.5, seed))
    for rows, truth in SPLIT.items():
        best = min(truth, key=truth.get)
        if all(ms > 1.5 * truth[best] for name, ms in truth.items() if name != best):
            assert plan.pick(rows) == quiet.pick(rows) == best, (rows, plan.describe())
    # one switch from "a" to "b", however the close buckets in between fall
    assert plan.used() == {"a", "b"}
    assert sum(x != y for x, y in zip(plan.choices, plan.choices[1:])) == 1


def test_a_candidate_far_behind_is_timed_no_further() -> None:
    """A candidate ``HOPELESS`` times slower than the best after its first round gets no
    more rounds in that bucket, nor in the second pass, and the plan is the same as when it
    is timed in full; one that could still win within the noise is timed in full."""
    slow = {1: {"a": 1.0, "b": 1.2, "aten": 40.0}, 2: {"a": 2.0, "b": 1.5, "aten": 7.0}}
    candidates, exact = scripted(slow)
    rounds: dict[tuple[int, str], int] = {}

    def timer(name: str, fn, calls: int) -> float:
        rows = 1 if exact("a", fn, calls) == 1.0 else 2
        rounds[rows, name] = rounds.get((rows, name), 0) + 1
        return exact(name, fn, calls)

    plan = choose([1, 2], candidates, timer)
    assert plan.choices == ("a", "b") and plan.timings[0]["aten"] == 40.0
    assert rounds[1, "aten"] == 2  # the warm-up call and one round, in the first pass only
    assert rounds[2, "aten"] == 2  # 7.0 > 4 x 1.5
    assert rounds[1, "b"] > 2 * selector.PASSES and rounds[2, "a"] > 2 * selector.PASSES
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(selector, "HOPELESS", float("inf"))
        assert choose([1, 2], *scripted(slow)).choices == plan.choices


def test_neighbouring_buckets_flip_only_on_a_win_past_the_margin() -> None:
    timings = [{"a": 1.0, "b": 1.01}, {"a": 1.0, "b": 0.97}, {"a": 0.98, "b": 1.0},
               {"a": 1.5, "b": 1.0}, {"a": 1.0, "b": 1.03}]
    assert selector.steady_choices(timings, {"a", "b"}, 0.05) == ["a", "a", "a", "b", "b"]
    assert selector.steady_choices(timings, {"a", "b"}, 0.0) == ["a", "b", "a", "b", "a"]


def test_plans_keep_how_they_were_made(tmp_path: Path) -> None:
    plan = choose([1, 2], *noisy({1: {"a": 1.0, "b": 2.0}, 2: {"a": 1.0, "b": 2.0}}, 0.4, 0))
    assert plan.made_at > 0 and plan.load is not None and plan.noise > 0
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))) == plan


def test_plan_describes_merged_spans() -> None:
    plan = Plan((8, 16, 64, 128), ("onednn", "panels", "panels", "mkl"))
    assert plan.describe() == "onednn 1-8, panels 9-64, mkl 65+ rows"
    assert plan.used() == {"onednn", "panels", "mkl"}
    assert Plan.always("torch").pick(10_000) == "torch"


def test_plans_are_cached_per_host_and_never_reused_on_another(tmp_path: Path) -> None:
    key = {"cpu": "CPU A", "flags": "avx2 fma", "torch": "2.13.0", "kernels": "k1",
           "threads": "2"}
    calls = []

    def candidates(rows: int) -> dict:
        calls.append(rows)
        return named(rows, ["tidal", "torch"])

    timer = fake_timer({"tidal": 1.0, "torch": 2.0})
    first = PlanCache(tmp_path, key, timer)
    plan = first.get_or_choose("op|x", [1, 2], candidates)
    first.save()
    assert plan.choices == ("tidal", "tidal") and calls == [1, 2] * selector.PASSES
    again = PlanCache(tmp_path, dict(key), timer)
    calls.clear()
    assert again.get_or_choose("op|x", [1, 2], candidates) == plan and calls == []
    assert again.measured == []
    for field, other in (("cpu", "CPU B"), ("flags", "avx2 fma avx512f"), ("torch", "2.14.0"),
                         ("kernels", "k2"), ("threads", "4")):
        elsewhere = PlanCache(tmp_path, {**key, field: other}, timer)
        assert elsewhere.plans == {}, field
    # A file whose recorded host differs is not read, even under the same name.
    path = first.path
    data = json.loads(path.read_text())
    data["host"]["cpu"] = "CPU C"
    path.write_text(json.dumps(data))
    assert PlanCache(tmp_path, key, timer).plans == {}
    # A larger step (another --max-num-batched-tokens) is timed anew; a plan timed for a
    # larger step then serves a smaller one, its largest row count not a power of two too.
    calls.clear()
    wide = again.get_or_choose("op|x", [1, 2, 4, 8], candidates)
    assert calls == [1, 2, 4, 8] * selector.PASSES
    calls.clear()
    assert again.get_or_choose("op|x", [1, 2], candidates) == wide
    assert again.get_or_choose("op|x", [1, 2, 4, 6], candidates) == wide and calls == []
    again.get_or_choose("op|x", [1, 2, 4, 8, 12], candidates)
    assert calls == [1, 2, 4, 8, 12] * selector.PASSES


def test_mode_reads_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIDAL_NO_CPU_KERNELS", raising=False)
    for value in ("auto", "force", "off"):
        monkeypatch.setenv(selector.MODE_ENV, value)
        assert selector.mode() == value
    monkeypatch.setenv(selector.MODE_ENV, "fast")
    with pytest.raises(ValueError, match="TIDAL_CPU_KERNELS"):
        selector.mode()
    monkeypatch.setenv(selector.MODE_ENV, "auto")
    monkeypatch.setenv("TIDAL_NO_CPU_KERNELS", "1")
    assert selector.mode() == "off"


def _model(tmp_path: Path):
    from tidal.gpu.model_config import ModelConfig
    from tidal.gpu.model_loader import LoadOptions, load_model
    from tidal.gpu.random_model import build_model_dir

    path = build_model_dir(tmp_path / "m", hidden_size=128)  # head_dim 32, the kernels' size
    cfg = ModelConfig.from_dir(path)
    return path, cfg, lambda cache=None: load_model(path, cfg, LoadOptions(
        get_attention_backend("cpu", "cpu"), 256, torch.float32, "cpu", max_rows=64, max_seqs=8,
        plan_cache=cache))


@needs_kernels
@pytest.mark.parametrize("winner", [KERNELS, TORCH])
def test_plans_reach_the_model_and_its_outputs_stay_the_same(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, winner: str) -> None:
    """With timings that make one side win everywhere, every module runs that side (the decode
    stack only where the kernels win), and the logits match torch's reference path."""
    monkeypatch.setenv(selector.MODE_ENV, "auto")

    def timer(name: str, fn, calls: int) -> float:
        if winner == KERNELS:  # tidal's kernels, its panel GEMM, its one-call decode step
            return 1.0 if name in (KERNELS, "panels", op_plans.STACK) else 5.0
        return 1.0 if name in (TORCH, op_plans.LAYERS) else 5.0

    _, cfg, load = _model(tmp_path)
    model, cpu = load(PlanCache(tmp_path / "cache", timer=timer))
    norm, attn = model.norm, model.layers[0].self_attn
    assert norm.plan.used() == {winner} and attn.rotary.plan.used() == {winner}
    assert attn.backend.decode_plan.used() == {winner}
    assert model.layers[0].mlp.act_fn.plan.used() == {winner}
    assert attn.qkv_proj.plan.used() == {"panels" if winner == KERNELS else TORCH}
    assert all(cpu.stack_rows) == (winner == KERNELS) and any(cpu.stack_rows) == all(
        cpu.stack_rows)
    assert list((tmp_path / "cache").glob("cpu_plans-*.json"))

    monkeypatch.setenv(selector.MODE_ENV, "off")
    reference = load().model
    ids = torch.tensor([3, 7, 11, 2])
    from tidal.gpu.attention.paged_layout import paged_layout, random_caches

    meta = paged_layout([0], [4], 16, seed=0)
    caches = [random_caches(meta, 16, cfg.num_kv_heads, cfg.head_dim)
              for _ in range(cfg.num_layers)]
    with torch.inference_mode():
        got = model(ids, torch.arange(4), [tuple(c.clone() for c in kv) for kv in caches], meta)
        want = reference(ids, torch.arange(4), [tuple(c.clone() for c in kv) for kv in caches],
                         meta)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_op_candidate_agrees_with_torch(tmp_path: Path, dtype: torch.dtype) -> None:
    _, cfg, load = _model(tmp_path)
    model = load().model
    attn = model.layers[0].self_attn
    families = [op_plans._norm_candidates(cfg.hidden_size, dtype),
                op_plans._act_candidates(cfg.intermediate_size, dtype),
                op_plans._rotary_candidates(attn.rotary, cfg, dtype),
                op_plans._attention_candidates(attn.backend, cfg, dtype, decode=True)]
    if dtype == torch.float32:
        families.append(op_plans._attention_candidates(attn.backend, cfg, dtype, decode=False))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    with torch.inference_mode():
        for candidates in families:
            for rows in (1, 5, 32):
                fns = candidates(rows)
                want, got = fns[TORCH](), fns[KERNELS]()
                for w, g in zip(torch.utils._pytree.tree_leaves(want),
                                torch.utils._pytree.tree_leaves(got)):
                    torch.testing.assert_close(g.float(), w.float(), rtol=tol, atol=tol)


@needs_kernels
@pytest.mark.parametrize("step_winner", [op_plans.STACK, op_plans.LAYERS])
def test_the_one_call_decode_step_is_timed_as_a_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step_winner: str) -> None:
    """Torch wins SiLU-and-mul alone, tidal's kernels every other op: the one-call decode step
    still runs where it wins as a whole, and only there."""
    monkeypatch.setenv(selector.MODE_ENV, "auto")

    def timer(name: str, fn, calls: int) -> float:
        if name in (op_plans.STACK, op_plans.LAYERS):
            return 1.0 if name == step_winner else 5.0
        return 1.0 if name in (KERNELS, "panels") else 5.0

    _, cfg, load = _model(tmp_path)
    cache = PlanCache(tmp_path / "cache", timer=timer)
    buckets = tuple(selector.row_buckets(64))  # the loader's max_rows
    cache.plans[f"silu_and_mul|{cfg.intermediate_size}|float32"] = Plan(
        buckets, (TORCH,) * len(buckets))  # as if timed so on this host
    model, cpu = load(cache)
    assert model.layers[0].mlp.act_fn.plan.used() == {TORCH}
    assert cpu.stack is not None
    assert all(cpu.stack_rows[1:]) == (step_winner == op_plans.STACK)
    assert any(cpu.stack_rows[1:]) == all(cpu.stack_rows[1:])
    rows = 3
    fns = op_plans._stack_candidates(model, cpu)(rows)
    torch.testing.assert_close(fns[op_plans.STACK](), fns[op_plans.LAYERS](), rtol=1e-4,
                               atol=1e-4)
