"""Token decoders: a sequence's new token ids to the text they complete, decoding only the
last few ids per step.

- ``StreamDecoder`` runs tokenizers' ``DecodeStream`` where the tokenizer decodes through its
  ``tokenizers`` backend; ``OffsetDecoder`` runs prefix/read offsets over the ids (vLLM's
  ``detokenize_incrementally``) for any other tokenizer. Both hold back text that ends in an
  incomplete UTF-8 character until the ids that complete it arrive.
- Under a byte-level decoder most tokens need no decoding at all: their text is the same
  wherever they stand (``TokenPieces``).
- The decoder starts primed with the end of the prompt, so the first output tokens are spaced as
  they are after the prompt: ``decode(prompt) + output_text == decode(prompt + output)``. For a
  byte-level BPE that is also ``decode(output)``; a SentencePiece-style decoder would drop the
  leading space of a first token decoded on its own.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable
from functools import cache, partial
from typing import Any, Protocol

from tokenizers import decoders

try:
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers older than 0.21: offsets only
    Tokenizer = DecodeStream = None  # type: ignore[assignment, misc]

REPLACEMENT_CHAR = "\ufffd"
# Ids held back at most before their text is released as it stands. An incomplete character
# needs at most 3 more byte tokens (a few more with skipped special tokens between them); the
# cap bounds the work per step when a model emits a long run of invalid UTF-8.
MAX_HELD_TOKENS = 32
# The prompt tail the decoder is primed with: the shortest one of at least MIN tokens, at most
# MAX, that decodes to whole characters (none: the output is decoded on its own).
MIN_PROMPT_CONTEXT, MAX_PROMPT_CONTEXT = 4, 24
# Decoded by the tokenizer and by its backend to tell whether the two agree (no clean-up of
# spaces around punctuation on top of the backend, the same special tokens skipped).
_PROBE_TEXT = "Hi , there . It 's fine , isn't it ? Yes ! 😀 你好"

Decode = Callable[[list[int]], str]


class TokenDecoder(Protocol):
    def step(self, token_id: int) -> str:
        """The text that ``token_id`` completes ("" while it is held back)."""

    def flush(self) -> str:
        """The text of the ids held back, as they stand."""


class OffsetDecoder:
    """Incremental decoding by prefix/read offsets over the ids (vLLM's
    ``detokenize_incrementally``); works with any tokenizer that has ``decode``.

    ``ids`` runs from the prefix offset: the ids of the last text released, which give the next
    ones their context, then the ids from the read offset on, whose text is not out yet. Each
    step decodes ``ids`` and releases what it adds to the prefix's text, unless that ends in an
    incomplete character.
    """

    def __init__(self, decode: Decode, context: list[int]) -> None:
        self._decode = decode
        self._ids = list(context)
        self._read = len(self._ids)
        self._prefix_text = decode(self._ids)

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._decode(self._ids)
        if _is_incomplete(text, self._prefix_text) and \
                len(self._ids) - self._read < MAX_HELD_TOKENS:
            return ""
        return self._advance(text)

    def flush(self) -> str:
        if self._read == len(self._ids):
            return ""
        return self._advance(self._decode(self._ids))

    def _advance(self, text: str) -> str:
        delta = text[len(self._prefix_text):]
        del self._ids[:self._read]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return delta


class StreamDecoder:
    """Incremental decoding by tokenizers' ``DecodeStream``.

    ``DecodeStream`` does not hand back the ids it holds, so they are mirrored here (``held``,
    after ``context``: the ids of the last text released): ``flush`` decodes them as they stand,
    and the stream restarts after them. Should the stream fail (it refuses a decoder that
    rewrites earlier text), decoding goes on by offsets from the same point.
    """

    def __init__(self, backend: Tokenizer, decode: Decode, skip_special_tokens: bool,
                 context: list[int], pieces: TokenPieces | None = None) -> None:
        self._backend = backend
        self._decode = decode
        self._skip = skip_special_tokens
        self._pieces = pieces
        self._offsets: OffsetDecoder | None = None
        self._restart(context)

    def step(self, token_id: int) -> str:
        if self._offsets is not None:
            return self._offsets.step(token_id)
        if self._pieces is not None and not self._held:
            piece = self._pieces[token_id]
            if piece is not None:  # nothing held: only the context moves on
                self._context, self._stream = [token_id], None
                return piece
        if self._stream is None:
            self._stream = _new_stream(self._backend, self._context, self._skip)
        try:
            text = self._stream.step(self._backend, token_id)
        except Exception:  # tokenizers raises a bare Exception ("Invalid prefix encountered")
            self._offsets = OffsetDecoder(self._decode, self._context)
            return "".join([self._offsets.step(t) for t in [*self._held, token_id]])
        if text is None:
            self._held.append(token_id)
            return self.flush() if len(self._held) >= MAX_HELD_TOKENS else ""
        self._held.append(token_id)
        self._context, self._held = self._held, []
        return text

    def flush(self) -> str:
        if self._offsets is not None:
            return self._offsets.flush()
        if not self._held:
            return ""
        prefix = self._decode(self._context)
        text = self._decode(self._context + self._held)
        self._restart(self._held)
        return text[len(prefix):]

    def _restart(self, context: list[int]) -> None:
        """Go on after ``context``, the ids of the last text released. The stream is built
        when a token needs it: under ``TokenPieces`` most never do."""
        self._stream: Any = None
        self._context = context
        self._held: list[int] = []


class TokenPieces(dict[int, "str | None"]):
    """The text of each token that decodes alike wherever it stands, under a byte-level
    decoder; looked up, and learned on first sight, in place of a ``DecodeStream`` step.

    A byte-level decoder maps each token to bytes on its own and decodes their concatenation
    as UTF-8, replacing what is invalid. A token whose bytes are valid UTF-8 by themselves
    therefore adds exactly its own text after any earlier ids, as long as none are held back
    (an incomplete character before it would come out as U+FFFD with it). Tokens that are not
    whole characters (``None`` here) go through the stream.

    A dict subclass so that a known token (nearly every one) costs a plain lookup; an unknown
    one is decoded in ``__missing__``.
    """

    def __init__(self, backend: Tokenizer, skip_special_tokens: bool) -> None:
        super().__init__()
        self._decode = partial(backend.decode, skip_special_tokens=skip_special_tokens)

    def __missing__(self, token_id: int) -> str | None:
        text = self._decode([token_id])
        piece = self[token_id] = None if REPLACEMENT_CHAR in text else text
        return piece


def make_token_decoder(tokenizer: Any, prompt_token_ids: list[int],
                       skip_special_tokens: bool) -> TokenDecoder:
    """A ``StreamDecoder`` where ``DecodeStream`` decodes as the tokenizer does, else an
    ``OffsetDecoder``; primed with the end of the prompt."""
    backend = stream_backend(tokenizer)
    if backend is not None:
        decode = partial(backend.decode, skip_special_tokens=skip_special_tokens)
        context = _prompt_context(decode, prompt_token_ids)
        return StreamDecoder(backend, decode, skip_special_tokens, context,
                             token_pieces(tokenizer, backend, skip_special_tokens))
    decode = partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)
    return OffsetDecoder(decode, _prompt_context(decode, prompt_token_ids))


_UNKNOWN = object()
_STREAM_BACKENDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TOKEN_PIECES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def token_pieces(tokenizer: Any, backend: Tokenizer,
                 skip_special_tokens: bool) -> TokenPieces | None:
    """The tokenizer's shared ``TokenPieces`` if its backend's decoder is byte-level (and the
    tokenizer weak-referenceable), else None."""
    if not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    try:
        per_skip = _TOKEN_PIECES.setdefault(tokenizer, {})
    except TypeError:
        return None
    if skip_special_tokens not in per_skip:
        per_skip[skip_special_tokens] = TokenPieces(backend, skip_special_tokens)
    return per_skip[skip_special_tokens]


def stream_backend(tokenizer: Any) -> Tokenizer | None:
    """The tokenizer's ``tokenizers`` backend if ``DecodeStream`` over it decodes as the
    tokenizer's own ``decode`` does (checked once per tokenizer on a probe), else None."""
    try:
        known = _STREAM_BACKENDS.get(tokenizer, _UNKNOWN)
    except TypeError:  # not weak-referenceable
        known = _UNKNOWN
    if known is not _UNKNOWN:
        return known
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if DecodeStream is None or not isinstance(backend, Tokenizer):
        result = None
    else:
        probe = backend.encode(_PROBE_TEXT, add_special_tokens=False).ids
        probe += list(getattr(tokenizer, "all_special_ids", []))[:4]
        agree = all(tokenizer.decode(probe, skip_special_tokens=skip)
                    == backend.decode(probe, skip_special_tokens=skip) for skip in (True, False))
        result = backend if agree else None
    try:
        _STREAM_BACKENDS[tokenizer] = result
    except TypeError:
        pass
    return result


def _new_stream(backend: Tokenizer, context: list[int], skip_special_tokens: bool) -> Any:
    try:
        return DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
    except TypeError:  # tokenizers before 0.22: no prefill argument
        stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for token_id in context:
            stream.step(backend, token_id)
        return stream


def _prompt_context(decode: Decode, prompt_token_ids: list[int]) -> list[int]:
    """The shortest tail of the prompt, of MIN_PROMPT_CONTEXT tokens or more, that decodes to
    whole characters; none if no tail up to MAX_PROMPT_CONTEXT tokens does."""
    n = len(prompt_token_ids)
    for size in range(min(MIN_PROMPT_CONTEXT, n), min(MAX_PROMPT_CONTEXT, n) + 1):
        tail = prompt_token_ids[n - size:]
        if REPLACEMENT_CHAR not in decode(tail):
            return tail
    return []


def _is_incomplete(text: str, prefix_text: str) -> bool:
    """True while the newest ids add nothing to the text yet: no new characters, or text that
    ends in an incomplete character."""
    return len(text) <= len(prefix_text) or text.endswith(REPLACEMENT_CHAR)


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer: Any, token_id: int) -> bytes | None:
    """The bytes token ``token_id`` stands for, which its decoded text cannot give where the
    token is part of a character (that decodes to U+FFFD): under a byte-level decoder, its
    token string read through the byte-level alphabet; a byte-fallback token (``<0xC3>``), its
    byte. None for any other token: its text is then its bytes."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str):
        return None
    if match := _BYTE_FALLBACK.fullmatch(piece):
        return bytes([int(match.group(1), 16)])
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    alphabet = _byte_level_alphabet()
    if not all(char in alphabet for char in piece):  # an added token, kept as written
        return None
    return bytes(alphabet[char] for char in piece)


@cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character to byte: printable bytes stand for themselves,
    the other 68 for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}
