"""bench/spec_decode.py: a ratio is taken within a round and the median round's run is the one
reported, every round's ratio beside it; the copy workload's replies repeat their prompts."""

import pytest

from bench.spec_decode import _median_round, continuations, prompts_for, repeating_model


def test_the_median_rounds_run_is_reported_with_every_rounds_ratio() -> None:
    runs = [{"output_tok_s": 300.0, "vs_none": 2.5}, {"output_tok_s": 100.0, "vs_none": 0.9},
            {"output_tok_s": 200.0, "vs_none": 1.5}]
    got = _median_round(runs)
    assert got["output_tok_s"] == 200.0 and got["vs_none"] == 1.5
    assert got["rounds_vs_none"] == [2.5, 0.9, 1.5]
    assert got["rounds_tok_s"] == [300.0, 100.0, 200.0]
    two = _median_round(runs[:2])  # an even count: the lower of the middle two
    assert two["vs_none"] == 0.9


@pytest.mark.slow
def test_the_copy_workloads_reply_repeats_text_from_its_prompt(tmp_path) -> None:
    """Each prompt is ``P + G + P`` (``G``: the model's greedy continuation of ``P``), and
    the model's reply to it is ``G`` again: text already in its prompt."""
    model = str(repeating_model(tmp_path))
    prompts = prompts_for("repeating", model, 3, 24)
    for prompt, reply in zip(prompts, continuations(model, prompts, 24), strict=True):
        passage_len = (len(prompt) - 24) // 2
        assert prompt[:passage_len] == prompt[passage_len + 24:]
        assert reply == prompt[passage_len:passage_len + 24]
