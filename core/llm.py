"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from tidal.core.beam_search import BeamSearch, BeamSearchParams, BeamSequence
from tidal.core.chat_messages import content_text
from tidal.core.config import EngineConfig
from tidal.core.engine_core import EngineCore
from tidal.core.lifecycle import Arrival
from tidal.core.outputs import RequestOutput
from tidal.core.pooling import EmbeddingRequestOutput, embedding_output, pooling_params
from tidal.core.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Batch generation over the same engine the server uses, without threads or HTTP.

    Its config is ``offline``: on a CPU the default token budget is 1,024 tokens, not the
    server's 192: nothing streams, so fewer, larger steps only help."""

    def __init__(self, model: str | None = None, **engine_args: object) -> None:
        if model is None:
            from tidal.core import DEFAULT_MODEL

            model = DEFAULT_MODEL
        self.engine = EngineCore(EngineConfig(model=model, offline=True,
                                              **engine_args))  # type: ignore[arg-type]
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def shutdown(self) -> None:
        """Stop the worker processes of a tensor-parallel engine (they also end with this
        process)."""
        self.engine.shutdown()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in input order. A prompt is a string or a list
        of token ids; ``params`` is one for all prompts or one per prompt; ``priority`` one
        per prompt (the lower, the sooner), with ``scheduling_policy="priority"``."""
        prompts = _prompt_list(prompts)
        params_list = self._params_per_prompt(params, len(prompts))
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        results = self._run_all(prompts, params_list, priorities, use_tqdm)
        return list(results.values())

    def embed(self, prompts: Prompt | Sequence[Prompt],
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in input order, as vLLM's ``LLM.embed`` gives them
        (``out.outputs.embedding``); the engine must run ``runner="pooling"``."""
        prompts = _prompt_list(prompts)
        params = pooling_params()
        results = self._run_all(prompts, [params] * len(prompts), [0] * len(prompts), use_tqdm)
        return [embedding_output(out) for out in results.values()]

    def _run_all(self, prompts: list[Prompt], params: list[SamplingParams],
                 priorities: list[int], use_tqdm: bool) -> dict[str, RequestOutput]:
        """Queue every prompt (none, if one is refused), run them, and return their
        outputs in input order."""
        ids: list[str] = []
        try:
            for prompt, prompt_params, rank in zip(prompts, params, priorities):
                ids.append(self._add(prompt, prompt_params, rank))
        except Exception:
            self.engine.abort_requests(ids)  # none left queued for a later call to run
            raise
        results = self._run(ids, use_tqdm)
        return {i: results[i] for i in ids}

    def chat(self, conversations: list[dict] | list[list[dict]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts = [self.tokenizer.apply_chat_template(
            [{**m, "content": content_text(m.get("content"))} for m in c], tokenize=False,
            add_generation_prompt=add_generation_prompt) for c in conversations]
        token_ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(token_ids, params, use_tqdm)

    def beam_search(self, prompts: Prompt | Sequence[Prompt],
                    params: BeamSearchParams) -> list[list[BeamSequence]]:
        """Each prompt's ``params.beam_width`` best beams, best first, as HF's
        ``generate(num_beams=...)`` finds them (``core/beam_search.py``); a round of
        one-token requests, one per running beam of every prompt, at a time."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        searches = [BeamSearch(self._token_ids(p), params, self.engine.eos_token_ids)
                    for p in prompts]  # type: ignore[union-attr]
        while live := [s for s in searches if not s.done]:
            step = SamplingParams(max_tokens=1, temperature=0.0, logprobs=live[0].top_k,
                                  ignore_eos=True)
            ids = [[self._add(seq, step) for seq in s.requests()] for s in live]
            results = self._run([i for group in ids for i in group], use_tqdm=False)
            for search, group in zip(live, ids):
                search.advance([results[i].outputs[0].logprobs[0] for i in group])
        beams = [s.results() for s in searches]
        for found in beams:
            for beam in found:
                beam.text = self.tokenizer.decode(beam.tokens, skip_special_tokens=True)
        return beams

    def _token_ids(self, prompt: Prompt) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def _params_per_prompt(self, params: SamplingParams | Sequence[SamplingParams] | None,
                           n: int) -> list[SamplingParams]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            return [params] * n
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
        if not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError("params must be a SamplingParams or a list of them, one per prompt")
        return list(params)

    def _add(self, prompt: Prompt, params: SamplingParams, priority: int = 0) -> str:
        request_id = str(self._next_id)
        self._next_id += 1
        text = prompt if isinstance(prompt, str) else None
        token_ids = self._token_ids(prompt)
        self.engine.add_request(request_id, token_ids, params, prompt=text,
                                arrival=Arrival(priority=priority))
        return request_id

    def _run(self, ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm)
        start, num_tokens = time.perf_counter(), 0
        with self.engine.step_modes():  # held for the whole run, not per step
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    num_tokens += sum(len(o.token_ids) for o in delta.outputs)
                    if delta.request_id in results:
                        results[delta.request_id].merge(delta)
                    else:
                        results[delta.request_id] = delta
                    if delta.finished:
                        bar.update(1)
                elapsed = time.perf_counter() - start
                bar.set_postfix_str(f"{num_tokens / max(elapsed, 1e-9):.0f} tok/s", refresh=False)
        bar.close()
        return results


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (a string or token ids) or several, as a list."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]
