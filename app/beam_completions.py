"""``/v1/completions`` with ``use_beam_search``: each prompt's ``n`` best beams, found as HF's
``generate(num_beams=n)`` finds them (``core/beam_search.py``). Each round sends one one-token
request per running beam of every prompt to the engine, all at once; their shared prefixes come
from the prefix cache. The reply has ``n`` choices per prompt, best first (choice index
``prompt_index * n + rank``), each with its beam's text and ``finish_reason``."""

from __future__ import annotations

import asyncio
from typing import Any

from tidal.app.errors import ApiError
from tidal.app.handling import generate, usage
from tidal.app.prepare import PreparedCompletion
from tidal.app.server_state import ServerState
from tidal.core.beam_search import BeamSearch, BeamSequence
from tidal.core.outputs import TokenLogprobs
from tidal.core.sampling_params import SamplingParams


async def beam_completion(state: ServerState, prep: PreparedCompletion) -> tuple[int, Any]:
    assert prep.beam is not None
    eos = state.engine.core.eos_token_ids
    searches = [BeamSearch(p.token_ids, prep.beam, eos) for p in prep.prompts]
    step = SamplingParams(max_tokens=1, temperature=0.0, logprobs=searches[0].top_k,
                          ignore_eos=True)
    rounds = 0
    try:
        while live := [s for s in searches if not s.done]:
            scored = await asyncio.gather(*(
                _next_logprobs(state, f"{prep.request_id}-r{rounds}-{i}-{j}", seq, step, prep)
                for i, search in enumerate(live) for j, seq in enumerate(search.requests())))
            at = 0
            for search in live:
                count = len(search.running)
                search.advance(list(scored[at:at + count]))
                at += count
            rounds += 1
    except ApiError as err:
        return err.status, err.to_dict()
    choices = [_choice(state, prep, p_index * prep.beam.beam_width + rank, p_index, beam)
               for p_index, search in enumerate(searches)
               for rank, beam in enumerate(search.results())]
    generated = sum(len(beam.tokens) for s in searches for beam in s.results())
    prompt_tokens = sum(len(p.token_ids) for p in prep.prompts)
    return 200, {"id": prep.request_id, "object": "text_completion", "created": prep.created,
                 "model": prep.model, "choices": choices,
                 "usage": usage(prompt_tokens, generated, 0)}


async def _next_logprobs(state: ServerState, request_id: str, token_ids: list[int],
                         step: SamplingParams, prep: PreparedCompletion) -> TokenLogprobs:
    """The top next-token logprobs after ``token_ids`` (one engine request, one token)."""
    logprobs: TokenLogprobs = {}
    async for out in generate(state, request_id, token_ids, step, None, prep.arrival):
        for comp in out.outputs:
            if comp.logprobs:
                logprobs = comp.logprobs[0]
    return logprobs


def _choice(state: ServerState, prep: PreparedCompletion, index: int, p_index: int,
            beam: BeamSequence) -> dict[str, Any]:
    text = state.tokenizer.decode(beam.tokens, skip_special_tokens=True)
    if prep.echo:
        text = prep.prompts[p_index].text + text
    return {"index": index, "text": text, "logprobs": None, "finish_reason": beam.finish_reason,
            "cumulative_logprob": beam.cum_logprob, "score": beam.score}
