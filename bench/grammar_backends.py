"""xgrammar against llguidance on this project's workloads: grammar compile time (cold and
cached), the time to fill the token bitmask of a batch of 32 constrained rows per step, and
the time to apply it to the logits, for vocabularies of 4,000 (the benchmark Llama), 4,096
(the embedded model) and 151,936 tokens (Qwen's size, a byte-level BPE trained here).

    python -m bench.grammar_backends [--batch 32] [--steps 40]

Writes ``bench/results/grammar_backends.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from bench.common import RESULTS_DIR, host_line, machine, write_result
from bench.structured_workload import MID_SCHEMA, mid_instance
from tidal.core.structured_output.compiler import bounded_strings

CACHE = Path.home() / ".cache" / "tidal" / "bench"
BIG_VOCAB = 151936


def big_tokenizer():
    """A byte-level BPE of ``BIG_VOCAB`` tokens trained on Shakespeare plus made-up words,
    numbers and JSON fragments, so the vocabulary is as varied as a real 152K one."""
    from transformers import PreTrainedTokenizerFast

    path = CACHE / f"bpe-{BIG_VOCAB}"
    if not (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        rng = random.Random(0)
        syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in "aeiouy"] + list("aeiou")
        words = ["".join(rng.choices(syllables, k=rng.randint(1, 5))) for _ in range(400_000)]
        shakespeare = Path("/work/shared/data/tinyshakespeare.txt")
        lines = shakespeare.read_text().splitlines() if shakespeare.is_file() else []
        for _ in range(40_000):
            picked = rng.choices(words, k=12)
            lines.append(" ".join(picked))
            lines.append(json.dumps({picked[0]: picked[1:4], picked[4]: rng.randint(0, 10**6)}))
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=BIG_VOCAB, special_tokens=["<|end|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(lines, trainer=trainer)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")
        fast.save_pretrained(path)
    return PreTrainedTokenizerFast.from_pretrained(path)


def tokenizers() -> dict[str, object]:
    from transformers import AutoTokenizer

    from tidal.gpu.random_model import build_tokenizer

    root = Path(__file__).resolve().parent.parent
    return {"bench-llama-4000": build_tokenizer(4000),
            "embedded-4096": AutoTokenizer.from_pretrained(root / "core" / "default_model"),
            f"bpe-{BIG_VOCAB}": big_tokenizer()}


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return (time.perf_counter() - start) * 1e3, out


def sequences(tokenizer, batch: int) -> list[list[int]]:
    """Token ids of ``batch`` different valid instances of the schema."""
    return [tokenizer.encode(json.dumps(mid_instance(i)), add_special_tokens=False)
            for i in range(batch)]


def run_xgrammar(tokenizer, vocab: int, batch: int, steps: int) -> dict:
    import xgrammar as xgr

    prep_ms, info = timed(lambda: xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab))
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    schema = json.dumps(bounded_strings(MID_SCHEMA))  # as the engine compiles it

    def compile_schema():
        return compiler.compile_json_schema(schema, any_whitespace=False)

    cold_ms, compiled = timed(compile_schema)
    cached_ms, _ = timed(compile_schema)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    batcher = xgr.BatchGrammarMatcher(max_threads=2)
    bitmask = xgr.allocate_token_bitmask(batch, vocab)
    fill, rejected = walk(sequences(tokenizer, batch), steps,
                          lambda: batcher.batch_fill_next_token_bitmask(matchers, bitmask),
                          lambda row, token: matchers[row].accept_token(token))
    logits = torch.randn(batch, vocab)
    return summary(prep_ms, cold_ms, cached_ms, fill, rejected,
                   lambda: xgr.apply_token_bitmask_inplace(logits, bitmask))


def run_llguidance(tokenizer, vocab: int, batch: int, steps: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt

    prep_ms, lltok = timed(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(MID_SCHEMA)
    cold_ms, first = timed(lambda: llguidance.LLMatcher(lltok, grammar))
    cached_ms, _ = timed(lambda: llguidance.LLMatcher(lltok, grammar))
    matchers = [first] + [llguidance.LLMatcher(lltok, grammar) for _ in range(batch - 1)]
    executor = llguidance.LLExecutor(num_threads=2)
    bitmask = llt.allocate_token_bitmask(batch, vocab)
    pairs = [(m, i) for i, m in enumerate(matchers)]
    fill, rejected = walk(sequences(tokenizer, batch), steps,
                          lambda: llt.fill_next_token_bitmask_par(executor, pairs, bitmask),
                          lambda row, token: matchers[row].consume_token(token))
    logits = torch.randn(batch, vocab)
    return summary(prep_ms, cold_ms, cached_ms, fill, rejected,
                   lambda: llt.apply_token_bitmask_inplace(logits, bitmask))


def walk(seqs: list[list[int]], steps: int, fill: Callable[[], object],
         accept: Callable[[int, int], bool]) -> tuple[list[float], int]:
    """Each step's bitmask fill time while every row advances through its own valid JSON,
    and how many of the tokens the matchers rejected (none, if the backend is right)."""
    times, rejected = [], 0
    for step in range(min(steps, *map(len, seqs))):  # every row still inside its JSON
        times.append(timed(fill)[0])
        for row, seq in enumerate(seqs):
            rejected += not accept(row, seq[step])
    return times, rejected


def summary(prep_ms: float, cold_ms: float, cached_ms: float, fill: list[float],
            rejected: int, apply: Callable[[], object]) -> dict:
    apply_ms = float(np.median([timed(apply)[0] for _ in range(50)]))
    return dict(tokenizer_prep_ms=prep_ms, compile_cold_ms=cold_ms, compile_cached_ms=cached_ms,
                fill_ms_p50=float(np.median(fill)), fill_ms_p90=float(np.percentile(fill, 90)),
                apply_ms=apply_ms, rejected_tokens=rejected)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows = []
    for name, tokenizer in tokenizers().items():
        vocab = max(len(tokenizer), int(name.rsplit("-", 1)[1]))
        for backend, run in (("xgrammar", run_xgrammar), ("llguidance", run_llguidance)):
            result = run(tokenizer, vocab, args.batch, args.steps)
            rows.append({"vocab": name, "backend": backend, **result})
            print(rows[-1], flush=True)
    lines = [f"# Grammar backends: batch {args.batch}, {args.steps} steps, mid-sized JSON schema",
             "", host_line(machine()), "",
             "| vocab | backend | tokenizer prep ms | compile cold ms | compile cached ms | "
             "fill ms p50 | fill ms p90 | apply ms p50 | rejected |", "|---" * 9 + "|"]
    for r in rows:
        lines.append(f"| {r['vocab']} | {r['backend']} | {r['tokenizer_prep_ms']:.1f} | "
                     f"{r['compile_cold_ms']:.1f} | {r['compile_cached_ms']:.2f} | "
                     f"{r['fill_ms_p50']:.3f} | {r['fill_ms_p90']:.3f} | {r['apply_ms']:.3f} | "
                     f"{r['rejected_tokens']} |")
    write_result("grammar_backends", {"batch": args.batch, "steps": args.steps, "rows": rows})
    (RESULTS_DIR / "grammar_backends.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
