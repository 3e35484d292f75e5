"""Training sequences: plain-text windows of the plays and chats made of consecutive speeches.

Every sequence is ``seq_len`` tokens and starts with ``<|begin_of_text|>``. A plain window is a
random slice of the tokenized training text. A chat is one or more conversations packed back to
back, each rendered by the chat template: consecutive speeches alternate as user and assistant
turns, every turn closed by ``<|end|>`` (the EOS), so the model learns to answer a message with
one speech and stop. Turns longer than ``max_turn_tokens`` end a conversation, which keeps
replies short enough to finish well within a typical ``max_tokens``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerFast

from tidal.gpu.training.corpus import Speech
from tidal.gpu.training.tokenizer import BOS, render_turn


@dataclass
class MixConfig:
    seq_len: int = 256
    chat_fraction: float = 0.5  # share of sequences that are chats
    max_turn_tokens: int = 150
    max_turns: int = 8
    system_fraction: float = 0.2  # share of conversations opened by a system turn


class ExampleSampler:
    """Draws training batches from a seeded ``random.Random``: the same seed, the same batches."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, train_text: str,
                 speeches: list[Speech], mix: MixConfig, seed: int) -> None:
        self.mix = mix
        self.rng = random.Random(seed)
        self.bos = tokenizer.convert_tokens_to_ids(BOS)
        self.text_ids = tokenizer(train_text, add_special_tokens=False)["input_ids"]
        self.speakers = [s.speaker for s in speeches]
        self.turns = {role: [_encode(tokenizer, render_turn(role, s.text)) for s in speeches]
                      for role in ("user", "assistant")}
        self.systems = {name: _encode(tokenizer, render_turn("system", _persona(name)))
                        for name in set(self.speakers)}

    def batch(self, batch_size: int) -> torch.Tensor:
        rows = [self.chat() if self.rng.random() < self.mix.chat_fraction else self.plain()
                for _ in range(batch_size)]
        return torch.tensor(rows, dtype=torch.long)

    def plain(self) -> list[int]:
        n = self.mix.seq_len - 1
        start = self.rng.randrange(len(self.text_ids) - n)
        return [self.bos] + self.text_ids[start:start + n]

    def chat(self) -> list[int]:
        ids: list[int] = []
        while len(ids) < self.mix.seq_len:
            ids += self.conversation()
        return ids[:self.mix.seq_len]

    def conversation(self) -> list[int]:
        """``<|begin_of_text|>`` [system] user assistant [user assistant ...]."""
        while True:
            first = self.rng.randrange(len(self.speakers) - 1)
            turns = self._turns_from(first)
            if turns:
                break
        ids = [self.bos]
        if self.rng.random() < self.mix.system_fraction:
            ids += self.systems[self.speakers[first + 1]]
        for turn in turns:
            ids += turn
        return ids

    def _turns_from(self, first: int) -> list[list[int]]:
        """Up to ``max_turns`` alternating turns from speech ``first`` on, ending on an
        assistant turn; empty when not even one user/assistant pair fits."""
        wanted = 2 * self.rng.randint(1, self.mix.max_turns // 2)
        turns: list[list[int]] = []
        for i in range(first, min(first + wanted, len(self.speakers))):
            turn = self.turns["user" if len(turns) % 2 == 0 else "assistant"][i]
            if len(turn) > self.mix.max_turn_tokens:
                break
            turns.append(turn)
        return turns[:len(turns) - len(turns) % 2]


def _encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _persona(speaker: str) -> str:
    return f"You are {speaker.title()}."
