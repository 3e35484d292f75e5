"""Held-out loss in nats per character: the bar the default model is measured against.

The held-out text is tokenized as plain text and scored with a sliding window: each window is
``<|begin_of_text|>`` plus up to ``context - 1`` tokens, and only its last ``stride`` tokens are
counted, so every token (after the first window) is predicted with at least
``context - 1 - stride`` tokens before it. The sum of their negative log-likelihoods divided by
the number of characters does not depend on how the tokenizer cuts the text.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase


@torch.no_grad()
def nats_per_char(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, text: str,
                  context: int, stride: int | None = None, batch_size: int = 16) -> float:
    """Total negative log-likelihood of ``text`` over its number of characters."""
    return total_nll(model, tokenizer, text, context, stride, batch_size) / len(text)


@torch.no_grad()
def total_nll(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, text: str,
              context: int, stride: int | None = None, batch_size: int = 16) -> float:
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    stride = stride or context // 2
    windows = [_window(ids, start, min(start + stride, len(ids)), context, tokenizer.bos_token_id)
               for start in range(0, len(ids), stride)]
    total = 0.0
    for length in sorted({len(w[0]) for w in windows}):
        same = [w for w in windows if len(w[0]) == length]
        for i in range(0, len(same), batch_size):
            total += _score(model, same[i:i + batch_size])
    return total


def _window(ids: list[int], start: int, end: int, context: int,
            bos: int) -> tuple[list[int], int]:
    """(input ids, how many of its last tokens are scored) for the tokens ``ids[start:end]``."""
    begin = max(0, end - (context - 1))
    return [bos] + ids[begin:end], end - start


def _score(model: PreTrainedModel, windows: list[tuple[list[int], int]]) -> float:
    inputs = torch.tensor([w[0] for w in windows], device=model.device)
    logits = model(input_ids=inputs).logits.float()
    logprobs = F.log_softmax(logits[:, :-1], dim=-1)
    token_lp = logprobs.gather(-1, inputs[:, 1:, None])[..., 0]
    return -sum(token_lp[row, -n:].sum().item() for row, (_, n) in enumerate(windows))
