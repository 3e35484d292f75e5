"""Verifies proposed (draft) tokens against the target model, exact in distribution.

A request with ``k`` proposals has ``k + 1`` logits rows this step: row ``j`` is the target's
distribution after the proposals before ``j``. Row ``j``'s draft is accepted
- greedy: when it is the row's argmax (after the request's logit edits);
- sampling: with probability ``p(draft)``, ``p`` the row's distribution after temperature,
  min_p, top-k/top-p and the edits (rejection sampling for a deterministic draft); on
  rejection the row's token is drawn from ``p`` with the draft removed (renormalised).
The request keeps its proposals up to the first rejection and that row's token (or, all
accepted, the bonus row's). Accepting ``t`` with ``p(t)`` and else drawing from ``p`` without
``t`` gives ``t`` with ``p(t)`` and any other ``s`` with ``(1 - p(t)) p(s) / (1 - p(t))``:
the target's distribution exactly.
"""

from __future__ import annotations

import torch

from tidal.gpu.sampler import SamplerOutput, draw, process_logits, random_probs, row_argmax
from tidal.gpu.sampling_metadata import RandomRows, SamplingMetadata


def verify(logits: torch.Tensor, meta: SamplingMetadata, drafts: torch.Tensor) -> SamplerOutput:
    """Each row's token and whether its draft was accepted. ``logits`` [N, vocab] float32 (may
    be modified in place), ``meta`` of the N rows, ``drafts`` [N] long: the token proposed
    for each row, -1 where none was (a request's last row, or one without proposals).

    ``sampled_token_ids`` is the accepted draft where ``accepted``, else the target's token;
    logprobs (of the raw logits) are those of that token."""
    raw_logprobs = None
    if meta.max_num_logprobs is not None:
        raw_logprobs = torch.log_softmax(logits, dim=-1)
    has_draft = drafts >= 0
    if meta.plain_greedy:
        target = row_argmax(logits)
        accepted = has_draft & (target == drafts)
    else:
        logits = process_logits(logits, meta)
        target = (torch.zeros_like(drafts) if meta.all_random else row_argmax(logits))
        accepted = has_draft & (target == drafts)
        if meta.random is not None:
            _verify_random(logits, meta.random, drafts, target, accepted)
    chosen = torch.where(accepted, drafts, target)
    if raw_logprobs is None:
        return SamplerOutput(chosen, None, None, accepted)
    assert meta.max_num_logprobs is not None
    top = raw_logprobs.topk(meta.max_num_logprobs, dim=-1).indices
    token_ids = torch.cat([chosen[:, None], top], dim=1)
    return SamplerOutput(chosen, token_ids, raw_logprobs.gather(1, token_ids), accepted)


def _verify_random(logits: torch.Tensor, r: RandomRows, drafts: torch.Tensor,
                   target: torch.Tensor, accepted: torch.Tensor) -> None:
    """Rejection sampling on the sampling rows, into ``target`` and ``accepted``."""
    sub = logits if r.all_rows else logits[r.rows]
    probs = random_probs(sub, r)
    d = drafts if r.all_rows else drafts[r.rows]
    has = d >= 0
    safe = d.clamp_min(0)[:, None]
    p_draft = probs.gather(1, safe).squeeze(1)
    ok = has & (_uniforms(r, probs) < p_draft)
    # the draft taken out of the rows that have one (the draw needs no renormalising)
    probs.scatter_(1, safe, torch.where(has, torch.zeros_like(p_draft), p_draft)[:, None])
    drawn = draw(probs, r)
    if r.all_rows:
        target.copy_(drawn)
        accepted.copy_(ok)
    else:
        target.index_copy_(0, r.rows, drawn)
        accepted.index_copy_(0, r.rows, ok)


def _uniforms(r: RandomRows, probs: torch.Tensor) -> torch.Tensor:
    """One U[0, 1) per sampling row, seeded rows with a proposal drawing from their
    generators (before the draw's, in row order, so a seed replays). A request's rows
    are consecutive and share its generator, and only its last has no proposal: that row, and
    a seeded request without proposals, draws nothing here, so its generator advances as the
    sampler's does in a step without proposals (its tokens then do not depend on whether
    the step verified others' proposals)."""
    u = torch.rand(probs.shape[0], device=probs.device)
    generators = r.generators
    for row, generator in generators.items():
        if generators.get(row + 1) is generator:  # not its request's last row
            u[row] = torch.rand(1, generator=generator, device=probs.device)[0]
    return u
