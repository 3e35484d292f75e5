"""Text prompts of an exact token length, so that servers which only take text (``transformers
serve``) and tidal see the same prompts with the same number of tokens.

Random token ids do not survive a decode/encode round trip unchanged (byte-level pieces merge
or split), so the text is re-encoded and trimmed or extended until it encodes to exactly the
asked length.
"""

from __future__ import annotations

import random
from typing import Any

MAX_ROUNDS = 50


def token_count(tokenizer: Any, text: str) -> int:
    """Tokens the servers see: ``tokenizer(text)`` with its default special tokens."""
    return len(tokenizer(text)["input_ids"])


def clean_pieces(tokenizer: Any) -> list[int]:
    """Token ids that decode to whole characters and encode back to themselves alone (no
    special tokens, no partial UTF-8 bytes), so random sequences of them round-trip well."""
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    texts = tokenizer.batch_decode([[i] for i in ids])
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [i for i, text, enc in zip(ids, texts, encoded)
            if enc == [i] and "\ufffd" not in text and text.strip()]


def exact_length_text(tokenizer: Any, length: int, rng: random.Random,
                      prefix: str = "", pieces: list[int] | None = None) -> str:
    """A text of random tokens that, after ``prefix``, encodes to exactly ``length`` tokens in
    total (``prefix`` included). Raises ``ValueError`` when no such text is found."""
    pieces = pieces or clean_pieces(tokenizer)
    ids: list[int] = []
    for _ in range(MAX_ROUNDS):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        have = token_count(tokenizer, prefix + text) if (prefix or text) else 0
        if have == length:
            return prefix + text
        if have < length:
            ids += [rng.choice(pieces) for _ in range(length - have)]
        else:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids = ids[:max(0, len(ids) - (have - length))]
    raise ValueError(f"no text of exactly {length} tokens found in {MAX_ROUNDS} rounds")


def text_prompts(tokenizer: Any, num: int, length: int, seed: int = 0,
                 prefix: str = "") -> list[str]:
    """``num`` distinct prompts of ``length`` tokens each, all starting with ``prefix``."""
    rng = random.Random(seed)
    pieces = clean_pieces(tokenizer)
    return [exact_length_text(tokenizer, length, rng, prefix, pieces) for _ in range(num)]
