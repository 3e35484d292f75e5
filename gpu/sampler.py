"""Greedy sampling with logprobs (the full sampler with penalties and top-k/p lands next)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor
    logprob_token_ids: torch.Tensor | None
    logprobs: torch.Tensor | None


class Sampler(torch.nn.Module):
    def forward(self, logits: torch.Tensor, max_num_logprobs: int | None) -> SamplerOutput:
        ids = logits.argmax(-1)
        if max_num_logprobs is None:
            return SamplerOutput(ids, None, None)
        lp = torch.log_softmax(logits, -1)
        top = lp.topk(max_num_logprobs, -1)
        token_ids = torch.cat([ids[:, None], top.indices], 1)
        return SamplerOutput(ids, token_ids, lp.gather(1, token_ids))
