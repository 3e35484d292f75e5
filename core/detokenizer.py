"""Incremental detokenization of one sequence's output, with stop strings.

Each step turns a sequence's new token ids into the text that became final:

- A token decoder (``core/token_decoders.py``) turns the ids into text, holding back what ends
  in an incomplete UTF-8 character.
- A stop-string matcher finds stop strings however the text is split across tokens. Text that
  could be the beginning of a stop string is held back, so a stop string is never handed out,
  and the output is cut where the stop string begins (or ends, with
  ``include_stop_str_in_output``). Finishing releases everything held back.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from tidal.core.sampling_params import SamplingParams
from tidal.core.token_decoders import make_token_decoder

_VOCAB_SIZES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class DetokenizationError(ValueError):
    """A token id the tokenizer cannot decode (outside its vocabulary)."""


class IncrementalDetokenizer:
    """One sequence's output text, built as its tokens arrive.

    ``update`` decodes the new tokens and looks for stop strings; ``get_delta`` hands out the
    text that became final since its previous call; ``output_text`` is all text so far, the part
    held back included. After a stop string or the finishing update, updates are ignored.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int],
                 params: SamplingParams) -> None:
        self._vocab_size = vocab_size(tokenizer)
        self._decoder = make_token_decoder(tokenizer, list(prompt_token_ids),
                                           params.skip_special_tokens)
        self._stops = StopStringMatcher(params.stop) if params.stop else None
        self.include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._num_tokens = 0
        self._done = False
        self._final: list[str] = []  # all final text
        self._unsent = ""  # final text not handed out yet
        self._held = ""  # text that may be the beginning of a stop string

    @property
    def output_text(self) -> str:
        if len(self._final) > 1:
            self._final[:] = ["".join(self._final)]
        return (self._final[0] if self._final else "") + self._held

    def update(self, new_token_ids: Sequence[int], finished: bool) -> str | None:
        """Decode ``new_token_ids``; returns the stop string that matched, or None.

        Raises ``DetokenizationError`` for an id outside the vocabulary, before decoding any.
        """
        if self._done:
            return None
        text, stop_floor = self._decode(new_token_ids)
        if finished:
            text += self._decoder.flush()
            self._done = True
        match = self._stops.feed(text, stop_floor) if self._stops else None
        if match is not None:
            start, stop = match
            cut = len(self._held) + start + (len(stop) if self.include_stop else 0)
            self._release((self._held + text)[:cut], "")
            self._done = True
            return stop
        if finished or self._stops is None or self.include_stop:
            self._release(self._held + text, "")
        else:
            pending = self._held + text  # the matcher's tail is a suffix of it
            keep = len(pending) - len(self._stops.tail)
            self._release(pending[:keep], pending[keep:])
        return None

    def update_and_get_delta(self, new_token_ids: Sequence[int],
                             finished: bool) -> tuple[str | None, str]:
        """``update``, then ``get_delta``: the stop string that matched (or None) and the text
        that became final. The common step (no stop strings, one valid id, nothing unsent)
        is decoded here in one call: it runs for every request of every step."""
        if (self._stops is None and not finished and not self._done and not self._unsent
                and len(new_token_ids) == 1 and 0 <= new_token_ids[0] < self._vocab_size):
            self._num_tokens += 1
            text = self._decoder.step(new_token_ids[0])
            if text:
                self._final.append(text)
            return None, text
        stop = self.update(new_token_ids, finished)
        return stop, self.get_delta()

    def get_delta(self) -> str:
        """The text that became final since the previous call."""
        delta, self._unsent = self._unsent, ""
        return delta

    def _decode(self, token_ids: Sequence[int]) -> tuple[str, int]:
        """The new text, and how many of its characters come from tokens within
        ``min_tokens``: a stop string must end after those (vLLM's rule). Checks every id
        before decoding any."""
        if len(token_ids) != 1 or not 0 <= token_ids[0] < self._vocab_size:
            self._check_ids(token_ids)  # one valid id: nearly every step, checked inline
        step = self._decoder.step
        before = self._num_tokens
        self._num_tokens += len(token_ids)
        if before >= self._min_tokens:
            if len(token_ids) == 1:
                return step(token_ids[0]), 0
            return "".join([step(t) for t in token_ids]), 0
        split = self._min_tokens - before
        head = "".join([step(t) for t in token_ids[:split]])
        return head + "".join([step(t) for t in token_ids[split:]]), len(head)

    def _check_ids(self, token_ids: Sequence[int]) -> None:
        for token_id in token_ids:
            if not 0 <= token_id < self._vocab_size:
                raise DetokenizationError(f"token id {token_id} is outside the vocabulary "
                                          f"[0, {self._vocab_size})")

    def _release(self, final: str, held: str) -> None:
        if final:
            self._final.append(final)
            self._unsent += final
        self._held = held


class StopStringMatcher:
    """Finds the first stop string to be completed in text that arrives piece by piece.

    Of the text seen, only ``tail`` is kept: its longest suffix that is a proper prefix of a stop
    string. A match that ends in a new piece starts inside ``tail`` or the piece, so each piece is
    searched together with ``tail`` alone and the work per piece does not grow with the text.
    The stop string completed first wins; of two completed by the same character, the longer.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(dict.fromkeys(stops))
        self.tail = ""

    def feed(self, piece: str, min_end: int = 0) -> tuple[int, str] | None:
        """The first stop string that ends in ``piece`` after its first ``min_end`` characters,
        as (start, stop string) with start relative to ``piece`` (negative when it began in
        earlier text); None if there is none."""
        window = self.tail + piece
        lo = len(self.tail) + min_end  # a match must end after window[lo - 1]
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stops:
            start = window.find(stop, max(0, lo - len(stop) + 1))
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        if best is not None:
            return best[1] - len(self.tail), best[2]
        self.tail = self._stop_prefix_suffix(window)
        return None

    def _stop_prefix_suffix(self, text: str) -> str:
        """The longest suffix of ``text`` that is a proper prefix of a stop string."""
        if not text:
            return ""
        last, best = text[-1], 0
        for stop in self.stops:
            # A prefix stop[:j + 1] can only be a suffix of text if stop[j] == text[-1].
            j = stop.rfind(last, 0, min(len(stop) - 1, len(text)))
            while j + 1 > best:
                if text.endswith(stop[:j + 1]):
                    best = j + 1
                    break
                j = stop.rfind(last, 0, j)
        return text[len(text) - best:] if best else ""


def vocab_size(tokenizer: Any) -> int:
    """``len(tokenizer)``, worked out once per tokenizer: a fast tokenizer rebuilds its whole
    vocabulary to count it (11 ms for Qwen2.5's 152K tokens, per request otherwise)."""
    size = _VOCAB_SIZES.get(tokenizer)
    if size is None:
        size = _VOCAB_SIZES[tokenizer] = len(tokenizer)
    return size
