import threading

import pytest
import torch

from tidal.core import SamplingParams
from tidal.core.sampling_params import check_token_ids, reply_budget


def test_defaults_are_valid():
    p = SamplingParams()
    assert p.n == 1 and p.max_tokens is None and not p.greedy


def test_an_unset_max_tokens_is_the_room_the_context_leaves():
    assert reply_budget(None, 10, 64) == 54
    assert reply_budget(7, 10, 64) == 7
    assert reply_budget(None, 64, 64) == 0 and reply_budget(None, 80, 64) == 0


def test_token_ids_are_checked_against_the_vocabulary():
    assert check_token_ids([0, 5, 9], 10, "prompt token id") == [0, 5, 9]
    with pytest.raises(ValueError, match="prompt token id 10 is outside the vocabulary"):
        check_token_ids([3, 10], 10, "prompt token id")
    with pytest.raises(ValueError, match="True is not an integer"):
        check_token_ids([True], 10, "prompt token id")


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", 2.0), ("presence_penalty", 3.0), ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0), ("max_tokens", 0), ("min_tokens", -1), ("logprobs", 21),
    ("seed", 1.5), ("n", True), ("seed", 2**64), ("seed", -(2**63) - 1), ("top_p", 1e-310),
    ("repetition_penalty", 5e-324), ("repetition_penalty", 1e-300), ("ignore_eos", "no"),
    ("skip_special_tokens", None), ("include_stop_str_in_output", 1), ("logit_bias", {7.9: 1.0}),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_stop_string_is_listified_and_min_tokens_bounded():
    assert SamplingParams(stop="\n").stop == ["\n"]
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 200.0})
    with pytest.raises(ValueError, match="^stop strings .* detokenize=False"):
        SamplingParams(stop=["\n"], detokenize=False)


def test_a_choice_seed_wraps_into_64_bits():
    params = SamplingParams(seed=2**64 - 2, n=4)
    assert [params.choice_seed(i) for i in range(4)] == [2**64 - 2, 2**64 - 1, 0, 1]
    assert SamplingParams(seed=-1).choice_seed(0) == 2**64 - 1
    assert SamplingParams().choice_seed(3) is None


def test_params_valid_here_stay_valid_where_denormals_are_flushed():
    """The engine thread flushes denormals and re-validates (``clone``): a subnormal is read
    as 0 on both sides, so no request passes here only to fail there."""
    params = SamplingParams(temperature=1e-310, min_p=1e-310, logit_bias={3: 1e-310})
    assert params.temperature == 0.0 and params.min_p == 0.0 and params.logit_bias == {3: 0.0}
    results = []

    def engine_side():
        torch.set_flush_denormal(True)
        try:
            results.append(params.clone())
        finally:
            torch.set_flush_denormal(False)

    thread = threading.Thread(target=engine_side)
    thread.start()
    thread.join()
    assert results == [params]
