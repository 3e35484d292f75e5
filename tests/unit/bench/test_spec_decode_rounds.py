"""bench/spec_decode.py's rounds: a ratio is taken within a round, and the median round's run
is the one reported, every round's ratio beside it."""

from bench.spec_decode import _median_round


def test_the_median_rounds_run_is_reported_with_every_rounds_ratio() -> None:
    runs = [{"output_tok_s": 300.0, "vs_none": 2.5}, {"output_tok_s": 100.0, "vs_none": 0.9},
            {"output_tok_s": 200.0, "vs_none": 1.5}]
    got = _median_round(runs)
    assert got["output_tok_s"] == 200.0 and got["vs_none"] == 1.5
    assert got["rounds_vs_none"] == [2.5, 0.9, 1.5]
    assert got["rounds_tok_s"] == [300.0, 100.0, 200.0]
    two = _median_round(runs[:2])  # an even count: the lower of the middle two
    assert two["vs_none"] == 0.9
