"""Prompt logprobs in the replies: vLLM's ``prompt_logprobs`` field (chat and completions),
and the echoed prompt's entries of a completion's legacy ``logprobs`` block."""

from __future__ import annotations

from typing import Any

from tidal.core.outputs import PromptLogprobs


def prompt_logprobs_json(scores: PromptLogprobs | None, token_ids: list[int],
                         k: int) -> list[dict[str, Any] | None] | None:
    """vLLM's JSON shape: ``None`` for the first token, then per token ``{"<token id>":
    {"logprob", "rank", "decoded_token"}}`` holding the prompt token and the top ``k`` (the
    engine may have scored more, for ``echo``)."""
    if scores is None:
        return None
    out: list[dict[str, Any] | None] = []
    for token_id, entry in zip(token_ids, scores):
        if entry is None:
            out.append(None)
            continue
        out.append({str(t): {"logprob": lp.logprob, "rank": lp.rank,
                             "decoded_token": lp.decoded_token}
                    for t, lp in entry.items()
                    if t == token_id or (lp.rank is not None and lp.rank <= k)})
    return out


def echoed_entries(scores: PromptLogprobs | None,
                   num_tokens: int) -> list[dict[int, float] | None]:
    """The echoed prompt's entries of the legacy ``logprobs`` block: ``{token id: logprob}``
    per token, ``None`` for the first (and for all, if the prompt was not scored)."""
    if scores is None:
        return [None] * num_tokens
    return [None if entry is None else {t: lp.logprob for t, lp in entry.items()}
            for entry in scores]
