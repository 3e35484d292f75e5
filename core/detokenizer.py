"""Detokenization of a request's output (whole-text decode; incremental version lands next)."""

from __future__ import annotations


class DetokenizationError(ValueError):
    pass


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids, params) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self.sent = 0
        self.output_text = ""

    def update(self, new_ids: list[int], finished: bool) -> str | None:
        self.ids += new_ids
        self.output_text = self.tok.decode(self.ids, skip_special_tokens=True)
        return None

    def get_delta(self) -> str:
        delta = self.output_text[self.sent:]
        self.sent = len(self.output_text)
        return delta
