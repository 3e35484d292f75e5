import pytest

from core import SamplingParams


def test_defaults_are_valid():
    p = SamplingParams()
    assert p.n == 1 and p.max_tokens == 16 and not p.greedy


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", 2.0), ("presence_penalty", 3.0), ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0), ("max_tokens", 0), ("min_tokens", -1), ("logprobs", 21),
    ("seed", 1.5), ("n", True),
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
