"""Sampling parameters for one request, validated on construction."""

from __future__ import annotations

import numbers
import sys
from dataclasses import dataclass, field

from tidal.core.structured_output.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
# A seed is what torch's generators take: any 64-bit pattern, signed or not.
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 64 - 1
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "detokenize")
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32
MAX_LOGPROBS = 20  # the most top logprobs a token (sampled or prompt) may ask for


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Field names follow vLLM and the OpenAI API.

    Invalid values raise ``ValueError`` naming the field and its allowed range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = None  # None: the room the context leaves (reply_budget)
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per sampled token; 0 = only the sampled one
    # top-k logprobs per prompt token, with the token's own (core/prompt_logprobs.py); with
    # them, ``max_tokens`` may be 0: the prompt is scored and nothing generated
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # False: token ids only, no text (offline use that wants ids, as HF ``generate`` gives)
    detokenize: bool = True
    # what the output must match (a JSON schema, a regex, a grammar, ...); None: anything
    structured_outputs: StructuredOutputsParams | None = None
    # the prompt is pooled into an embedding (an engine with runner "pooling",
    # core/pooling.py); ``max_tokens`` is 0 then: nothing is generated
    pooling: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        for name in _FLOAT_FIELDS:
            setattr(self, name, _flush_subnormal(getattr(self, name)))
        if self.logit_bias:
            self.logit_bias = {t: _flush_subnormal(b) for t, b in self.logit_bias.items()}
        self._validate()

    def _validate(self) -> None:
        _check_int("n", self.n, lo=1)
        _check_range("temperature", self.temperature, 0.0, None)
        _check_range("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_int("top_k", self.top_k, lo=0, note=" (0 or -1 disables it)")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        # logits are divided by it in float32, where anything smaller is 0
        _check_range("repetition_penalty", self.repetition_penalty, FLOAT32_TINY, None)
        if self.max_tokens is not None:
            scored = self.prompt_logprobs is not None or self.pooling
            _check_int("max_tokens", self.max_tokens, lo=0 if scored else 1,
                       note="" if scored else " (0 only with prompt_logprobs)")
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if self.seed is not None:
            _check_int("seed", self.seed, lo=SEED_MIN, hi=SEED_MAX)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_LOGPROBS)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are matched in the output text, which "
                             "detokenize=False does not make")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                   for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of non-negative integers")
        for token_id, bias in (self.logit_bias or {}).items():
            _check_int("logit_bias", token_id, lo=0, note=" (keys are token ids)")
            _check_range("logit_bias", bias, -100.0, 100.0)
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def choice_seed(self, index: int) -> int | None:
        """The seed of choice ``index`` of ``n``: ``seed + index``, wrapped into 64 bits (a
        generator seeded with -1 and one seeded with 2**64 - 1 draw the same)."""
        return None if self.seed is None else (self.seed + index) % 2 ** 64

    def clone(self, **changes: object) -> SamplingParams:
        values = {**self.__dict__, **changes}
        return SamplingParams(**values)


def _flush_subnormal(value: object) -> object:
    """A subnormal float as 0.0. The engine thread runs with denormals flushed to zero, where a
    subnormal compares as 0: read as 0 here too, a value valid on one thread is valid on both."""
    if isinstance(value, float) and value != 0.0 and abs(value) < sys.float_info.min:
        return 0.0
    return value


def _check_int(name: str, value: object, lo: int | None, hi: int | None = None,
               note: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{name} must be in [{lo}, {hi if hi is not None else 'inf'}]{note}, "
                         f"got {value}")


def _check_range(name: str, value: object, lo: float, hi: float | None,
                 lo_open: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
    too_low = value <= lo if lo_open else value < lo
    if too_low or (hi is not None and value > hi):
        left = "(" if lo_open else "["
        raise ValueError(f"{name} must be in {left}{lo}, {hi if hi is not None else 'inf'}], "
                         f"got {value}")


def reply_budget(max_tokens: int | None, num_prompt_tokens: int, context_tokens: int) -> int:
    """The tokens a reply may take: ``max_tokens`` when set, else the room the context leaves
    after the prompt. The one rule for an unset ``max_tokens``, the same for the HTTP API,
    the websocket chat and the offline ``LLM`` (docs/api.md); a prompt that fills the context
    leaves 0, which callers refuse."""
    if max_tokens is not None:
        return max_tokens
    return max(context_tokens - num_prompt_tokens, 0)


def check_token_ids(token_ids: list[int], vocab_size: int, what: str) -> list[int]:
    """``token_ids`` as Python ints, or ``ValueError`` naming the first that is not an integer
    (numpy's are) or lies outside the vocabulary: the one check of client-given token ids
    (prompts, ``logit_bias`` keys), for the HTTP API and the offline ``LLM`` alike."""
    for t in token_ids:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(f"{what} {t!r} is not an integer")
        if not 0 <= t < vocab_size:
            raise ValueError(f"{what} {t} is outside the vocabulary [0, {vocab_size})")
    return [int(t) for t in token_ids]
