"""Measure the default model against its quality bar, with HF transformers on the shipped files.

    python -m tidal.gpu.training.evaluate_default --data PATH/tinyshakespeare.txt

Prints the held-out loss in nats per character (bar: at most 1.75) and seeded chat replies to
one message (bar: at least 8 of 10 end with EOS within 200 tokens), each with the share of its
words that occur in the training text.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from tidal.core.config import DEFAULT_MODEL
from tidal.gpu.training.corpus import read_split
from tidal.gpu.training.heldout import nats_per_char

MAX_NATS_PER_CHAR = 1.75
MIN_SHARE_ENDED = 0.8
_WORD = re.compile(r"[a-z]+(?:'[a-z]+)*")


@dataclass
class Reply:
    seed: int
    text: str
    num_tokens: int
    ended: bool  # stopped on EOS within the token budget
    known_words: float  # share of its words that occur in the training text


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def sample_replies(model: PreTrainedModel, tokenizer, message: str, seeds: range,
                   max_new_tokens: int, vocabulary: set[str],
                   temperature: float | None) -> list[Reply]:
    """One sampled reply per seed, with the sampling defaults of generation_config.json
    unless ``temperature`` overrides them."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                           add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    overrides = {} if temperature is None else {"temperature": temperature, "top_p": 1.0}
    replies = []
    for seed in seeds:
        torch.manual_seed(seed)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                             max_new_tokens=max_new_tokens, **overrides)[0, ids.shape[1]:]
        tokens = out.tolist()
        ended = tokenizer.eos_token_id in tokens
        if ended:
            tokens = tokens[:tokens.index(tokenizer.eos_token_id)]
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        said = words(text)
        known = sum(w in vocabulary for w in said) / len(said) if said else 0.0
        replies.append(Reply(seed, text, len(out), ended, known))
    return replies


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="tinyshakespeare.txt")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--message", default="Tell me a joke")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=None,
                        help="sample at this temperature (top_p 1) instead of the defaults "
                             "in generation_config.json")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    split = read_split(args.data)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    context = model.config.max_position_embeddings
    loss = nats_per_char(model, tokenizer, split.held_out, context)
    print(f"held-out: last {len(split.held_out)} characters, "
          f"{len(tokenizer(split.held_out, add_special_tokens=False, verbose=False).input_ids)} "
          f"tokens, "
          f"{loss:.4f} nats/char (bar <= {MAX_NATS_PER_CHAR}) "
          f"{'PASS' if loss <= MAX_NATS_PER_CHAR else 'FAIL'}")

    sampling = (f"temperature {args.temperature}" if args.temperature is not None else
                f"temperature {model.generation_config.temperature}, "
                f"top_p {model.generation_config.top_p}")
    print(f"\nchat replies to {args.message!r} ({sampling}, seeds 0-{args.samples - 1}, "
          f"at most {args.max_new_tokens} tokens):")
    vocabulary = set(words(split.train))
    replies = sample_replies(model, tokenizer, args.message, range(args.samples),
                             args.max_new_tokens, vocabulary, args.temperature)
    for r in replies:
        end = "EOS" if r.ended else "no EOS"
        print(f"[seed {r.seed}] {r.num_tokens} tokens, {end}, "
              f"{r.known_words:.0%} known words: {r.text!r}")
    ended = sum(r.ended for r in replies)
    bar = math.ceil(MIN_SHARE_ENDED * len(replies))
    print(f"{ended}/{len(replies)} replies ended with EOS within {args.max_new_tokens} tokens "
          f"(bar >= {bar}) {'PASS' if ended >= bar else 'FAIL'}; "
          f"{sum(r.known_words for r in replies) / len(replies):.0%} of words known on average")


if __name__ == "__main__":
    main()
