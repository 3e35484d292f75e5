"""Which tokens a grammar may read as text.

xgrammar's ``TokenizerInfo.from_huggingface`` takes every token for its text, special tokens
included, so a grammar may let ``<|user|>`` stand for eight characters of a JSON string. The
detokenizer drops special tokens from the reply, so such a reply breaks its grammar (a
``minLength: 1`` string shows as ``""``). Here the special tokens get an empty text, which
xgrammar never allows, except:

- the stop tokens, which xgrammar handles apart from their text;
- the markers a structural tag writes (its ``begin``, ``end``, ``triggers``, ``separator`` and
  ``const_string`` values): Harmony's ``<|channel|>``, DeepSeek's ``<｜tool▁sep｜>``, ...
  The model writes those as single special tokens, and the requests that ask for them keep
  special tokens in their text (``app/prepare.py``).

A compiler is built per set of kept markers; ``MAX_COMPILERS`` of them are kept, the least
recently used first out.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from tidal.core.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

MAX_COMPILERS = 8
# a structural tag's keys whose strings the grammar writes as they stand
_LITERAL_KEYS = ("begin", "end", "triggers", "separator", "value")


def special_token_ids(tokenizer: Any, vocab_size: int) -> set[int]:
    """The tokens the detokenizer drops: the tokenizer's special tokens, and its added tokens
    marked special (which ``all_special_ids`` may not list)."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(i for i, token in added.items() if getattr(token, "special", False))
    return {i for i in ids if 0 <= i < vocab_size}


def tag_literals(spec: StructuredOutputsParams) -> list[str]:
    """The strings ``spec``'s structural tag writes as they stand (none for other kinds, or
    for a tag that is not JSON: its compile fails)."""
    tag = spec.structural_tag
    try:
        return list(_literals(json.loads(tag) if isinstance(tag, str) else tag))
    except ValueError:
        return []


def _literals(node: Any) -> Iterator[str]:
    if isinstance(node, list):
        for item in node:
            yield from _literals(item)
        return
    if not isinstance(node, dict) or node.get("type") == "json_schema":  # a schema's own data
        return
    for key, value in node.items():
        if key in _LITERAL_KEYS:
            yield from (v for v in (value if isinstance(value, list) else [value])
                        if isinstance(v, str))
        else:
            yield from _literals(value)


class TextTokens:
    """One tokenizer's vocabulary as xgrammar reads it, and the tokenizer infos that make its
    special tokens text only where a grammar's markers name them."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        base = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None)
        self.vocab: list[bytes] = list(base.decoded_vocab)
        self.vocab_size = vocab_size
        self.stop_token_ids: list[int] = list(base.stop_token_ids)
        self.add_prefix_space = bool(base.add_prefix_space)
        stops = set(self.stop_token_ids)
        self.special: dict[int, str] = {
            i: self.vocab[i].decode("utf-8", "replace")
            for i in sorted(special_token_ids(tokenizer, len(self.vocab))) if i not in stops}

    def kept(self, spec: StructuredOutputsParams) -> frozenset[int]:
        """The special tokens ``spec``'s grammar may write: those its markers hold."""
        literals = tag_literals(spec)
        return frozenset(i for i, text in self.special.items()
                         if text and any(text in literal for literal in literals))

    def info(self, kept: frozenset[int]) -> xgr.TokenizerInfo:
        """The vocabulary with every special token but ``kept`` (and the stops) blanked."""
        import xgrammar as xgr

        vocab = list(self.vocab)
        for i in self.special.keys() - kept:
            vocab[i] = b""
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                 stop_token_ids=self.stop_token_ids,
                                 add_prefix_space=self.add_prefix_space)
