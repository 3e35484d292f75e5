"""Tokenizers and token streams shared by the detokenizer and stop-string tests."""

from __future__ import annotations

import random

from tokenizers import Tokenizer

from tidal.core.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello 😀🎉 你好世界 café",
    "Emoji 🚀 and CJK 日本語 한국어 mix: naïve Ångström 😀😀",
    "<|user|>\nOnce upon a time<|end|> 你好<|assistant|>🎉",
    "12345 and 678.9 #@& \"like this\" w3w17 done.",
]


class PlainTokenizer:
    """A tokenizer with ``decode`` and a length only, like a slow (pure Python) one."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.decoded_lengths: list[int] = []

    def __len__(self) -> int:
        return len(self._tokenizer)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        self.decoded_lengths.append(len(ids))
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class CleaningTokenizer(PlainTokenizer):
    """A tokenizers-backed tokenizer whose ``decode`` cleans up spaces before punctuation, so a
    ``DecodeStream`` over its backend would not decode as it does."""

    @property
    def backend_tokenizer(self) -> Tokenizer:
        return self._tokenizer.backend_tokenizer

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return super().decode(ids, skip_special_tokens).replace(" ,", ",").replace(" .", ".")


def tokenizer_kinds(tokenizer) -> dict[str, object]:
    return {"stream": tokenizer, "offsets": PlainTokenizer(tokenizer)}


def split_ids(ids: list[int], chunking: str, seed: int = 0) -> list[list[int]]:
    if chunking == "one":
        return [[t] for t in ids]
    rng, out, i = random.Random(seed), [], 0
    while i < len(ids):
        size = rng.choice([1, 2, 3, 5, 8])
        out.append(ids[i:i + size])
        i += size
    return out


def feed(detok: IncrementalDetokenizer, chunks: list[list[int]], finish: bool = True,
         separately: bool = False) -> tuple[list[str], str | None]:
    """Feed ``chunks`` as the output processor does (or by ``update`` and ``get_delta``
    called separately); the deltas and the stop string."""
    deltas = []
    for i, chunk in enumerate(chunks):
        finished = finish and i == len(chunks) - 1
        if separately:
            stop = detok.update(chunk, finished)
            deltas.append(detok.get_delta())
        else:
            stop, delta = detok.update_and_get_delta(chunk, finished)
            deltas.append(delta)
        if stop is not None:
            return deltas, stop
    return deltas, None
