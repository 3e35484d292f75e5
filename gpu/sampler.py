"""Turns a step's logits into tokens, in vLLM's order: logit_bias and min_tokens, penalties,
temperature, min_p, top-k / top-p, then sampling; greedy rows take the argmax of the
processed logits. Logprobs are those of the model's raw logits.

Sampling is by inverse transform: one uniform per row, and the first token whose running sum
of probabilities (in float64) passes it. Unseeded rows take one batched draw and each seeded row
one draw from its own generator, so nothing waits on the host and a seeded row's tokens do not
depend on what else is in the batch. One uniform a row, rather than the exponential race's one
exponential per vocabulary entry, which torch draws on a CPU one value at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tidal.core.scheduler_output import GrammarBitmask
from tidal.gpu.cpu.kernels import load_cpu_kernels
from tidal.gpu.sampling_metadata import Penalties, RandomRows, SamplingMetadata


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B]
    logprob_token_ids: torch.Tensor | None  # [B, 1 + N]: the sampled token, then the top-N
    logprobs: torch.Tensor | None  # [B, 1 + N]
    accepted: torch.Tensor | None = None  # [B] bool: speculative steps (gpu/spec_verify.py)


class Sampler:
    """Holds no weights, so a plain callable rather than an ``nn.Module``, whose call
    machinery costs a few microseconds a step."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of the float32 ``logits`` [B, vocab], which may be
        modified in place."""
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if meta.plain_greedy:
            sampled = row_argmax(logits)
        else:
            logits = process_logits(logits, meta)
            sampled = sample(logits, meta)
        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None)
        top = raw_logprobs.topk(meta.max_num_logprobs, dim=-1).indices
        token_ids = torch.cat([sampled[:, None], top], dim=1)
        return SamplerOutput(sampled, token_ids, raw_logprobs.gather(1, token_ids))


def apply_grammar_bitmask(logits: torch.Tensor, grammar: GrammarBitmask,
                          row_req_ids: list[str]) -> None:
    """Set to -inf the logits of the tokens each constrained row's grammar does not allow
    next; ``row_req_ids`` names the request of each row of ``logits`` (a request's rows
    consecutive, one per bitmask row of its). Runs before every other logits edit, so
    temperature, top-k/p and penalties only see allowed tokens."""
    import xgrammar as xgr  # imported by the compile of the grammar that made the bitmask

    first: dict[str, int] = {}
    for i, req_id in enumerate(row_req_ids):
        first.setdefault(req_id, i)
    full = np.full((logits.shape[0], grammar.bitmask.shape[1]), -1, dtype=np.int32)
    num_rows = grammar.num_rows or [1] * len(grammar.req_ids)
    src = 0
    for req_id, n in zip(grammar.req_ids, num_rows):
        i = first.get(req_id)
        if i is not None:
            full[i:i + n] = grammar.bitmask[src:src + n]
        src += n
    mask = torch.from_numpy(full)
    if not logits.is_cpu:
        mask = mask.pin_memory().to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[-1])


def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """logit_bias, min_tokens and penalties: the edits that can change the argmax."""
    if meta.bias is not None:
        rows, tokens, values = meta.bias
        logits.index_put_((rows, tokens), values, accumulate=True)
    if meta.min_tokens is not None:
        rows, tokens = meta.min_tokens
        logits.index_put_((rows, tokens), logits.new_full((), float("-inf")))
    if meta.penalties is not None:
        apply_penalties(logits, meta.penalties)
    return logits


def apply_penalties(logits: torch.Tensor, p: Penalties) -> None:
    """Repetition (over prompt and output: positive logits divided, negative multiplied),
    then frequency and presence (over output, OpenAI's formula), on the penalised rows."""
    sub = logits if p.all_rows else logits[p.rows]
    num_rows, vocab = sub.shape
    counts = torch.zeros(num_rows, vocab, dtype=sub.dtype, device=sub.device)
    one = torch.ones((), dtype=sub.dtype, device=sub.device)
    counts.index_put_((p.output_rows, p.output_tokens), one.expand(p.output_rows.shape),
                      accumulate=True)
    if p.pending_rows is not None and p.pending_tokens is not None:
        counts.index_put_((p.pending_rows, p.pending_tokens),
                          one.expand(p.pending_rows.shape), accumulate=True)
    seen_in_output = counts > 0
    if p.repetition is not None:
        seen = seen_in_output.clone()
        seen.index_put_((p.prompt_rows, p.prompt_tokens),
                        torch.ones((), dtype=torch.bool, device=sub.device))
        rep = p.repetition[:, None]
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalised, sub)
    sub = sub - p.frequency[:, None] * counts - p.presence[:, None] * seen_in_output
    if p.all_rows:
        logits.copy_(sub)
    else:
        logits[p.rows] = sub


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's first maximum. On the CPU, for float32 rows, the compiled kernel
    (``argmax.cpp``, which reads a row 16 lanes at a time where torch's ``max`` runs a
    scalar loop); else ``max``'s indices, faster than ``argmax`` over a vocabulary row on a
    CPU, with the same first-index rule; elsewhere ``argmax``."""
    if not x.is_cpu:
        return x.argmax(dim=-1)
    kernels = load_cpu_kernels()
    if kernels is not None and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1:
        return kernels.argmax_rows(x)
    return x.max(dim=-1).indices


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    random = meta.random
    greedy = None if meta.all_random else row_argmax(logits)
    if random is None:
        assert greedy is not None
        return greedy
    sub = logits if random.all_rows else logits[random.rows]
    drawn = sample_random(sub, random)
    if greedy is None:
        return drawn
    return greedy.index_copy_(0, random.rows, drawn)


def sample_random(logits: torch.Tensor, r: RandomRows) -> torch.Tensor:
    """Temperature, min_p, top-k / top-p, then one draw, on the sampling rows."""
    return draw(random_probs(logits, r), r)


def random_probs(logits: torch.Tensor, r: RandomRows) -> torch.Tensor:
    """The sampling rows' distributions: temperature, min_p, top-k / top-p, softmax."""
    logits = logits.div_(r.temperature[:, None])
    if r.min_p is not None:
        apply_min_p(logits, r.min_p)
    if r.top_k is not None or r.top_p is not None:
        logits = apply_top_k_top_p(logits, r.top_k, r.top_p, r.max_top_k, r.all_top_k)
    return logits.softmax(dim=-1)


def draw(probs: torch.Tensor, r: RandomRows) -> torch.Tensor:
    """A token from each row of ``probs`` (which need not sum to one): the first whose
    running sum passes ``u`` times the row's total, ``u ~ U[0, 1)``, seeded rows drawing
    from their generators. Tokens of probability 0 are never drawn."""
    cdf = probs.to(torch.float64).cumsum_(dim=-1)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, dtype=torch.float64, device=probs.device)
    for row, generator in r.generators.items():
        u[row] = torch.rand(1, dtype=torch.float64, generator=generator, device=probs.device)
    # strictly below the total, so the token found has a probability above 0
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    # clamped: a row of NaNs (a broken model) finds no place in its cdf
    return torch.searchsorted(cdf, x, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens whose probability is below ``min_p`` times the top token's, compared in
    log space: p_i < min_p * p_max  <=>  l_i < l_max + log(min_p)."""
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log()[:, None]
    logits.masked_fill_(logits < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None,
                      max_k: int = 0, all_top_k: bool = False) -> torch.Tensor:
    """Keep each row's top ``k`` tokens (0: all; ties at the k-th value are kept), then the
    smallest set of the most likely whose probability reaches ``p``. ``max_k`` is the largest
    k and ``all_top_k`` whether every row has one, both known on the host so no device value
    is read back."""
    vocab = logits.shape[-1]
    if p is None:
        assert k is not None
        return _apply_top_k_only(logits, k, max_k)
    if k is not None and all_top_k:
        return _apply_top_p_within_top_k(logits, k, p, max_k)
    ordered, order = logits.sort(dim=-1, descending=False)
    if k is not None:
        kth = ordered.gather(1, (vocab - k.masked_fill(k == 0, vocab))[:, None])
        ordered.masked_fill_(ordered < kth, float("-inf"))
    cumulative = ordered.softmax(dim=-1).cumsum_(dim=-1)
    drop = cumulative <= 1 - p[:, None]
    drop[:, -1] = False  # the most likely token always stays
    ordered.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, order, ordered)


def _apply_top_k_only(logits: torch.Tensor, k: torch.Tensor, max_k: int) -> torch.Tensor:
    """Top-k without a full sort: one topk of the largest k asked for."""
    disabled = k == 0
    kth = logits.topk(max_k, dim=-1).values.gather(1, (k.masked_fill(disabled, 1) - 1)[:, None])
    kth.masked_fill_(disabled[:, None], float("-inf"))
    return logits.masked_fill_(logits < kth, float("-inf"))


def _apply_top_p_within_top_k(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor,
                              max_k: int) -> torch.Tensor:
    """Top-p when every row has a top-k: the nucleus lies inside the top ``max_k`` tokens, so
    only those are ranked instead of sorting the whole vocabulary."""
    values, indices = logits.topk(max_k, dim=-1)  # descending
    kth = values.gather(1, (k - 1)[:, None])
    values.masked_fill_(values < kth, float("-inf"))
    probs = values.softmax(dim=-1)
    above = probs.cumsum(dim=-1).sub_(probs)  # the mass of the more likely tokens
    values.masked_fill_(above >= p[:, None], float("-inf"))  # the first token always stays
    return logits.fill_(float("-inf")).scatter_(1, indices, values)
