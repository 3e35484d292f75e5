"""Incremental detokenization: streamed text equals a whole decode and never ends in half a
character (stop strings: ``test_stop_strings.py``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tests.token_streams import (
    TEXTS,
    CleaningTokenizer,
    PlainTokenizer,
    feed,
    split_ids,
    tokenizer_kinds,
)
from tidal.core import SamplingParams
from tidal.core.detokenizer import DetokenizationError, IncrementalDetokenizer
from tidal.core.token_decoders import (
    MAX_HELD_TOKENS,
    MAX_PROMPT_CONTEXT,
    REPLACEMENT_CHAR,
    OffsetDecoder,
    StreamDecoder,
    token_pieces,
)
from tidal.gpu.random_model import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


# -- text equals a whole decode, no U+FFFD ---------------------------------------------------

def test_stream_decoder_where_backend_decodes_alike(tokenizer):
    def decoder(tok):
        return IncrementalDetokenizer(tok, [], SamplingParams())._decoder

    assert isinstance(decoder(tokenizer), StreamDecoder)
    for other in (PlainTokenizer(tokenizer), CleaningTokenizer(tokenizer)):
        assert isinstance(decoder(other), OffsetDecoder)


@pytest.mark.parametrize("kind", ["stream", "offsets"])
@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("chunking", ["one", "uneven"])
def test_deltas_equal_whole_decode_without_replacement_chars(tokenizer, kind, skip, chunking):
    tok = tokenizer_kinds(tokenizer)[kind]
    prompt = tokenizer.encode("The quick brown fox: ")
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, prompt, SamplingParams(skip_special_tokens=skip))
        deltas, stop = feed(detok, split_ids(ids, chunking))
        assert stop is None
        assert not any(REPLACEMENT_CHAR in d for d in deltas), deltas
        expected = tokenizer.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) == expected == detok.output_text
        if chunking == "one" and not text.isascii():  # a character split over tokens was
            assert "" in deltas  # held back for a step


@pytest.mark.parametrize("stop", [[], ["fox"]])
@pytest.mark.parametrize("chunking", ["one", "uneven"])
def test_the_one_call_step_streams_as_update_and_get_delta_do(tokenizer, stop, chunking):
    """``update_and_get_delta`` (the output processor's call, with its inline common step)
    gives the deltas and stop string of ``update`` then ``get_delta``."""
    prompt = tokenizer.encode("Say: ")
    for text in [*TEXTS, "the quick brown fox jumps"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        runs = [feed(IncrementalDetokenizer(tokenizer, prompt, SamplingParams(stop=stop)),
                     split_ids(ids, chunking), separately=separately)
                for separately in (False, True)]
        assert runs[0] == runs[1]


@pytest.mark.parametrize("kind", ["stream", "offsets"])
def test_unfinished_character_held_until_finish_then_flushed(tokenizer, kind):
    partial = tokenizer.convert_tokens_to_ids(list("ðŁĺ"))  # the first 3 bytes of 😀
    ids = tokenizer.encode("ok ", add_special_tokens=False) + partial
    detok = IncrementalDetokenizer(tokenizer_kinds(tokenizer)[kind], [], SamplingParams())
    for token_id in ids:
        detok.update([token_id], finished=False)
    assert detok.get_delta() == "ok "
    detok.update([], finished=True)
    tail = detok.get_delta()
    assert tail.endswith(REPLACEMENT_CHAR) and "ok " + tail == tokenizer.decode(ids)


@pytest.mark.parametrize("kind", ["stream", "offsets"])
def test_long_invalid_utf8_run_released_at_the_cap(tokenizer, kind):
    """Stray continuation bytes never complete a character: past MAX_HELD_TOKENS they are
    released as they decode, without waiting for the finish."""
    stray = tokenizer.convert_tokens_to_ids("Ģ")  # byte 0x80
    ids = tokenizer.encode("ok", add_special_tokens=False) + [stray] * (MAX_HELD_TOKENS + 5)
    detok = IncrementalDetokenizer(tokenizer_kinds(tokenizer)[kind], [], SamplingParams())
    deltas, _ = feed(detok, split_ids(ids, "one"), finish=False)
    assert deltas[-1] == "" and REPLACEMENT_CHAR * MAX_HELD_TOKENS in "".join(deltas)
    detok.update([], finished=True)
    assert "".join(deltas) + detok.get_delta() == tokenizer.decode(ids)


def test_offsets_decode_a_bounded_window(tokenizer):
    """Work per token does not grow with the output: no decode spans more than the prompt
    context and the ids held back."""
    plain = PlainTokenizer(tokenizer)
    ids = tokenizer.encode(" ".join(TEXTS * 8), add_special_tokens=False)
    detok = IncrementalDetokenizer(plain, tokenizer.encode(TEXTS[0] * 4), SamplingParams())
    deltas, _ = feed(detok, split_ids(ids, "one"))
    assert len(ids) > 200
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert max(plain.decoded_lengths) <= MAX_PROMPT_CONTEXT + MAX_HELD_TOKENS


def _draw_ids_prompt_skip(tokenizer, data) -> tuple[list[int], list[int], bool]:
    """Any ids (invalid UTF-8 and special tokens included), a prompt and skip_special_tokens."""
    vocab = len(tokenizer)
    ids = data.draw(st.lists(st.integers(0, vocab - 1), max_size=40), label="ids")
    prompt = data.draw(st.lists(st.integers(0, vocab - 1), max_size=10), label="prompt")
    return ids, prompt, data.draw(st.booleans(), label="skip")


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_ids_decode_like_a_whole_decode(tokenizer, data):
    """Any ids, invalid UTF-8 and special tokens included, with any prompt and chunking."""
    ids, prompt, skip = _draw_ids_prompt_skip(tokenizer, data)
    kind = data.draw(st.sampled_from(["stream", "offsets"]), label="kind")
    sizes = data.draw(st.lists(st.integers(1, 6), min_size=len(ids), max_size=len(ids)))
    chunks, i = [], 0
    for size in sizes:
        if i < len(ids):
            chunks.append(ids[i:i + size])
            i += size
    detok = IncrementalDetokenizer(tokenizer_kinds(tokenizer)[kind], prompt,
                                   SamplingParams(skip_special_tokens=skip))
    deltas, _ = feed(detok, chunks or [[]])
    assert not any(d.endswith(REPLACEMENT_CHAR) for d in deltas[:-1])  # only the flush may
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_token_pieces_stream_the_same_deltas_as_the_stream_alone(tokenizer, data):
    """Step by step, not only in the end: any ids, invalid UTF-8 and special tokens included."""
    ids, prompt, skip = _draw_ids_prompt_skip(tokenizer, data)
    params = SamplingParams(skip_special_tokens=skip)
    deltas = []
    for use_pieces in (True, False):
        detok = IncrementalDetokenizer(tokenizer, prompt, params)
        assert detok._decoder._pieces is not None
        if not use_pieces:
            detok._decoder._pieces = None
        deltas.append(feed(detok, split_ids(ids, "one") or [[]])[0])
    assert deltas[0] == deltas[1]


def _metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer: a word's leading space is part of its token, and the
    decoder drops it from the first token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 10,
                            trainers.BpeTrainer(vocab_size=80))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.mark.parametrize("kind", ["stream", "offsets"])
def test_first_output_tokens_spaced_after_the_prompt(kind):
    tokenizer = _metaspace_tokenizer()
    ids = tokenizer.encode("the quick brown fox jumps over", add_special_tokens=False)
    prompt, output = ids[:3], ids[3:]
    detok = IncrementalDetokenizer(tokenizer_kinds(tokenizer)[kind], prompt, SamplingParams())
    deltas, _ = feed(detok, split_ids(output, "one"))
    assert tokenizer.decode(prompt) + "".join(deltas) == tokenizer.decode(ids)
    assert deltas[0].startswith(" ") and not tokenizer.decode(output).startswith(" ")


def test_failing_stream_goes_on_by_offsets(tokenizer, monkeypatch):
    """``DecodeStream`` refuses decoders that rewrite earlier text; decoding carries on."""

    class FailingStream:
        steps = 0

        def step(self, backend, token_id):
            FailingStream.steps += 1
            raise Exception("Invalid prefix encountered")

    ids = tokenizer.encode(TEXTS[1], add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    first, rest = ids[:9], ids[9:]
    detok.update(first, finished=False)
    detok._decoder._stream = FailingStream()
    monkeypatch.setattr("tidal.core.token_decoders._new_stream", lambda *args: FailingStream())
    detok.update(rest, finished=True)
    assert FailingStream.steps == 1
    assert detok.output_text == tokenizer.decode(ids)


def test_whole_character_tokens_skip_the_stream(tokenizer):
    """Under a byte-level decoder a token that is whole characters is looked up, not decoded
    by the stream; the stream picks up again, behind those tokens, for one that is not."""
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say: "), SamplingParams())
    decoder = detok._decoder
    words = tokenizer.encode("plain words, nothing more", add_special_tokens=False)
    for token_id in words:
        detok.update([token_id], finished=False)
    assert decoder._stream is None  # never needed
    emoji = tokenizer.encode(" 😀!", add_special_tokens=False)
    pieces = token_pieces(tokenizer, tokenizer.backend_tokenizer, True)
    assert pieces is not None and pieces[emoji[1]] is None  # part of a character
    assert pieces[words[0]] == tokenizer.decode([words[0]])
    for token_id in emoji:
        detok.update([token_id], finished=False)
    assert detok.get_delta() == tokenizer.decode(words + emoji)
    metaspace = _metaspace_tokenizer()
    assert token_pieces(metaspace, metaspace.backend_tokenizer, True) is None


def test_bad_token_id_raises(tokenizer):
    for kind in ("stream", "offsets"):
        detok = IncrementalDetokenizer(tokenizer_kinds(tokenizer)[kind], [], SamplingParams())
        for bad in (len(tokenizer), 10**9, -1):
            with pytest.raises(DetokenizationError, match=str(bad)):
                detok.update([5, bad], finished=False)
    assert issubclass(DetokenizationError, ValueError)


class _CountingLength(PlainTokenizer):
    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.lengths_taken = 0

    def __len__(self) -> int:
        self.lengths_taken += 1
        return super().__len__()


def test_vocabulary_counted_once_per_tokenizer(tokenizer):
    """A fast tokenizer rebuilds its vocabulary to count it (11 ms at 152K tokens), so the
    count is taken once, not per request."""
    counting = _CountingLength(tokenizer)
    for _ in range(3):
        detok = IncrementalDetokenizer(counting, [5, 6], SamplingParams())
        with pytest.raises(DetokenizationError):
            detok.update([len(tokenizer)], finished=False)
    assert counting.lengths_taken == 1
