"""Stop strings: found across tokens, held back while they may still match, cut off, and
finishing requests through the output processor and the engine."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.token_streams import feed, split_ids, tokenizer_kinds
from tidal.core import LLM, SamplingParams
from tidal.core.detokenizer import IncrementalDetokenizer
from tidal.core.output_processor import OutputProcessor, ParentRequest
from tidal.core.request import Request, RequestStatus
from tidal.core.scheduler import RequestUpdate
from tidal.core.token_decoders import REPLACEMENT_CHAR
from tidal.gpu.random_model import build_model_dir, build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


# -- stop strings ------------------------------------------------------------------------------

def _tokens_of(tokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.decode([t]) for t in ids]


def _spanning_stop(tokenizer, text: str, num_tokens: int) -> tuple[list[int], str, int]:
    """A stop string made of the end of one token, ``num_tokens - 2`` whole tokens and the
    start of another, in ``text``'s tokens; with where it begins in the text."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = _tokens_of(tokenizer, ids)
    for i in range(1, len(pieces) - num_tokens):
        span = pieces[i:i + num_tokens]
        if all(len(p) >= 2 and p.isascii() for p in (span[0], span[-1])):
            stop = span[0][-1] + "".join(span[1:-1]) + span[-1][0]
            start = len("".join(pieces[:i + 1])) - 1
            if text.find(stop) == start:
                return ids, stop, start
    raise AssertionError(f"no {num_tokens}-token stop string in {text!r}")


STOP_TEXT = "Once upon a time there was a small engine that served tokens very fast."


@pytest.mark.parametrize("kind", ["stream", "offsets"])
@pytest.mark.parametrize("num_tokens", [2, 3])
@pytest.mark.parametrize("chunking", ["one", "uneven"])
def test_stop_string_split_across_tokens(tokenizer, kind, num_tokens, chunking):
    ids, stop, start = _spanning_stop(tokenizer, STOP_TEXT, num_tokens)
    params = SamplingParams(stop=[stop])
    detok = IncrementalDetokenizer(tokenizer_kinds(tokenizer)[kind], [], params)
    deltas, matched = feed(detok, split_ids(ids, chunking), finish=False)
    assert matched == stop
    assert "".join(deltas) == STOP_TEXT[:start] == detok.output_text
    assert detok.update(ids[:2], finished=True) is None and detok.get_delta() == ""


def test_stop_string_is_never_handed_out(tokenizer):
    """Every prefix of a stop string that shows up is held back until it is decided."""
    ids, stop, start = _spanning_stop(tokenizer, STOP_TEXT, 3)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=[stop]))
    sent = ""
    for token_id in ids:
        matched = detok.update([token_id], finished=False)
        sent += detok.get_delta()
        assert STOP_TEXT[:start].startswith(sent)
        if matched:
            break
    assert matched == stop and sent == STOP_TEXT[:start]


@pytest.mark.parametrize("chunking", ["one", "uneven"])
def test_include_stop_str_in_output(tokenizer, chunking):
    ids, stop, start = _spanning_stop(tokenizer, STOP_TEXT, 3)
    params = SamplingParams(stop=[stop], include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    deltas, matched = feed(detok, split_ids(ids, chunking), finish=False)
    assert matched == stop
    assert "".join(deltas) == STOP_TEXT[:start + len(stop)]


@pytest.mark.parametrize("chunking", ["one", "uneven", "whole"])
def test_earliest_stop_string_wins(tokenizer, chunking):
    ids = tokenizer.encode(STOP_TEXT, add_special_tokens=False)
    chunks = [ids] if chunking == "whole" else split_ids(ids, chunking)
    for stops, winner in ((["tokens", "small", "time"], "time"),
                          (["served", "a small"], "a small"),
                          (["was a small engine", "small"], "small")):
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=stops))
        deltas, matched = feed(detok, chunks, finish=False)
        assert matched == winner
        assert "".join(deltas) == STOP_TEXT[:STOP_TEXT.find(winner)]


def test_held_prefix_released_when_it_is_no_stop(tokenizer):
    text = "Once upon a time there was a small engine"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["a smile", "there it"]))
    sent, held = "", set()
    for token_id in ids:
        assert detok.update([token_id], finished=False) is None
        sent += detok.get_delta()
        assert detok.output_text.startswith(sent)
        held.add(detok.output_text[len(sent):])
    assert {"there", "a"} <= held
    assert sent == text  # released without waiting for the finish


def test_held_prefix_flushed_at_finish(tokenizer):
    ids = tokenizer.encode("the quick brown", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["brown fox"]))
    assert detok.update(ids, finished=False) is None
    assert detok.get_delta() == "the quick "
    assert detok.output_text == "the quick brown"
    assert detok.update([], finished=True) is None
    assert detok.get_delta() == "brown"


def test_stop_strings_wait_for_min_tokens(tokenizer):
    """As in vLLM, a stop string must end after the text of the first ``min_tokens`` tokens."""
    text = "the cat and the dog"
    ids = tokenizer.encode(text, add_special_tokens=False)
    first_the = next(k for k in range(1, len(ids) + 1) if "the" in tokenizer.decode(ids[:k]))
    for min_tokens, expected in ((0, ""), (first_the, "the cat and ")):
        params = SamplingParams(stop=["the"], min_tokens=min_tokens)
        detok = IncrementalDetokenizer(tokenizer, [], params)
        deltas, matched = feed(detok, split_ids(ids, "one"), finish=False)
        assert matched == "the" and "".join(deltas) == expected


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_stop_strings_against_a_whole_text_search(tokenizer, data):
    """Whatever the chunking: output cut where the first-completed stop string begins (ends,
    when included), and no stop string ever appears in what was handed out."""
    alphabet = "ab c😀你"
    text = data.draw(st.text(alphabet, max_size=30), label="text")
    stops = data.draw(st.lists(st.text(alphabet, min_size=1, max_size=4), min_size=1,
                               max_size=3), label="stops")
    include = data.draw(st.booleans(), label="include")
    ids = tokenizer.encode(text, add_special_tokens=False)
    whole = tokenizer.decode(ids)
    found = [(whole.find(s) + len(s), whole.find(s), s) for s in stops if s in whole]
    chunks = split_ids(ids, "uneven", seed=data.draw(st.integers(0, 99)))
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=stops,
                                                          include_stop_str_in_output=include))
    sent, matched = "", None
    for i, chunk in enumerate(chunks):
        matched = detok.update(chunk, i == len(chunks) - 1)
        sent += detok.get_delta()
        if not include:
            assert not any(s in sent for s in stops)
        if matched:
            break
    if not found:
        assert matched is None and sent == whole
    else:
        end, start, stop = min(found, key=lambda f: (f[0], f[1]))
        assert matched == stop
        assert sent == whole[:end if include else start]


# -- through the output processor and the engine -----------------------------------------------

def _processor_with(tokenizer, num: int, params: SamplingParams):
    processor = OutputProcessor(tokenizer)
    requests = []
    for i in range(num):
        request = Request(str(i), [1, 2, 3], params)
        request.status = RequestStatus.RUNNING
        processor.add(ParentRequest(str(i), None, [1, 2, 3], {str(i): 0}), [request])
        requests.append(request)
    return processor, requests


def _engine_stop(request: Request, status: RequestStatus, reason) -> None:
    """What the engine does: finish a running request (a finished one is left alone)."""
    if not request.is_finished:
        request.status, request.stop_reason = status, reason


def test_bad_token_id_finishes_only_its_request(tokenizer):
    processor, (bad, good) = _processor_with(tokenizer, 2, SamplingParams())
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    updates = [RequestUpdate(bad, [ids[0], len(tokenizer) + 7], None, False),
               RequestUpdate(good, ids, None, False)]
    outputs = {o.request_id: o for o in processor.process(updates, [], _engine_stop)}
    assert outputs["0"].finished and outputs["0"].outputs[0].finish_reason == "error"
    assert "outside the vocabulary" in outputs["0"].error
    assert not outputs["1"].finished and outputs["1"].error is None
    assert outputs["1"].outputs[0].text == "hello world"
    more = tokenizer.encode(" again", add_special_tokens=False)
    good.status = RequestStatus.FINISHED_LENGTH_CAPPED
    (out,) = processor.process([RequestUpdate(good, more, None, True)], [], _engine_stop)
    assert out.finished and out.outputs[0].text == " again"
    assert out.outputs[0].finish_reason == "length"


def test_stop_string_on_the_last_token_finishes_with_stop(tokenizer):
    """A request the scheduler capped in the same step still finishes for its stop string."""
    processor, (request,) = _processor_with(tokenizer, 1, SamplingParams(stop=["world"]))
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    (out,) = processor.process([RequestUpdate(request, ids, None, True)], [], _engine_stop)
    completion = out.outputs[0]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", "world")
    assert completion.text == "hello "


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = build_model_dir(tmp_path_factory.mktemp("detok-llama"), "llama")
    return LLM(str(path), kv_cache_memory=1 << 22)


def test_llm_stops_at_a_stop_string_from_its_own_output(llm):
    prompts = ["Once upon a time", "Emoji 😀 and CJK 你好"]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    first = [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    for out in first:
        assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    text = first[0].text
    stop = next(text[i:i + 3] for i in range(len(text) // 3, len(text) - 3)
                if REPLACEMENT_CHAR not in text[i:i + 3] and text[i:i + 3].strip())
    start = text.find(stop)
    second = llm.generate(prompts, [greedy.clone(stop=[stop]), greedy], use_tqdm=False)
    stopped, other = second[0].outputs[0], second[1].outputs[0]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop)
    assert stopped.text == text[:start]
    assert stopped.token_ids == first[0].token_ids[:len(stopped.token_ids)]
    assert (other.text, other.finish_reason) == (first[1].text, "length")
    # capped on the very token that completes the stop string: still a stop
    num = next(k for k in range(1, 41)
               if stop in llm.tokenizer.decode(first[0].token_ids[:k], skip_special_tokens=True))
    (capped,) = llm.generate(prompts[:1], greedy.clone(stop=[stop], max_tokens=num,
                                                       include_stop_str_in_output=True),
                             use_tqdm=False)
    assert (capped.outputs[0].finish_reason, capped.outputs[0].stop_reason) == ("stop", stop)
    assert capped.outputs[0].text == text[:start + len(stop)]
