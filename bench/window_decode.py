"""Sliding-window layers at long context: decode speed at 8k tokens against 1k, and the KV
blocks a request holds, on a Gemma-3-shaped model.

The model: Gemma 3's layer pattern (five sliding-window layers to one global) and its 1B
model's layer width (hidden 1152, 4 query heads and 1 KV head of 256, MLP 6912, window 512),
random weights in float32, ``--layers`` layers. For each context length a prompt of that many
tokens is prefilled once (prefix-cached), then decoded; a decode token's time is the
difference between a 65-token and a 1-token generation over 64. While it decodes, the
blocks held in each group are sampled after every step: the full-attention layers hold the
whole history, the sliding-window layers at most their window's
(``core/kv_window.py``).

    python -m bench.window_decode [--short 1024] [--long 8192] [--layers 6]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import machine, write_result
from tidal.core import LLM, SamplingParams
from tidal.gpu.random_model import build_model_dir

GEMMA3_1B = dict(hidden_size=1152, intermediate_size=6912, num_attention_heads=4,
                 num_key_value_heads=1, head_dim=256, sliding_window=512,
                 sliding_window_pattern=6)
DECODE_TOKENS = 64


def build(path: Path, layers: int, max_len: int, tiny: bool) -> Path:
    shape = {} if tiny else dict(GEMMA3_1B)
    if tiny:
        shape.update(sliding_window=32, sliding_window_pattern=6)
    return build_model_dir(path, "gemma3", num_hidden_layers=layers,
                           max_position_embeddings=max_len, **shape)


class HeldBlocks:
    """The most blocks held in each group over the steps since the last ``reset``."""

    def __init__(self, llm: LLM) -> None:
        self.kv = llm.engine.kv
        step = llm.engine.step
        self.full = self.window = 0

        def sampled_step(*args: Any, **kwargs: Any) -> Any:
            out = step(*args, **kwargs)
            pool = self.kv.pool
            self.full = max(self.full, pool.num_blocks - pool.num_free_blocks)
            if self.kv.window is not None:
                self.window = max(self.window, self.kv.window.num_held())
            return out

        llm.engine.step = sampled_step

    def reset(self) -> None:
        self.full = self.window = 0


def decode_at(llm: LLM, held: HeldBlocks, context: int, vocab: int) -> dict[str, Any]:
    prompt = [10 + (i * 7919) % (vocab - 10) for i in range(context)]
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)  # prefilled, cached
    times = []
    for tokens in (1, DECODE_TOKENS + 1):
        held.reset()
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=tokens, ignore_eos=True,
                                              detokenize=False), use_tqdm=False)
        times.append(time.perf_counter() - start)
    ms = 1000 * (times[1] - times[0]) / DECODE_TOKENS
    return {"context": context, "decode_ms_per_token": round(ms, 3),
            "decode_tok_s": round(1000 / ms, 1), "full_blocks_held": held.full,
            "window_blocks_held": held.window}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--short", type=int, default=1024)
    ap.add_argument("--long", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--tiny", action="store_true", help="a tiny model, for a smoke run")
    ap.add_argument("--name", default="window_decode")
    args = ap.parse_args(argv)
    path = build(Path(tempfile.mkdtemp(prefix="tidal-window-")) / "gemma3", args.layers,
                 args.long + 256, args.tiny)
    llm = LLM(str(path), dtype="float32", max_model_len=args.long + 128, max_num_seqs=4,
              max_num_batched_tokens=256)
    held = HeldBlocks(llm)
    vocab = llm.engine.vocab_size
    runs = [decode_at(llm, held, n, vocab) for n in (args.short, args.long)]
    kv = llm.engine.kv
    group = kv.window
    result = {
        "machine": machine(), "settings": vars(args) | {"shape": "tiny" if args.tiny
                                                         else GEMMA3_1B},
        "block_size": kv.block_size, "runs": runs,
        "window_pool_blocks": group.pool.num_blocks if group else None,
        "long_over_short": round(runs[1]["decode_tok_s"] / runs[0]["decode_tok_s"], 3)}
    write_result(args.name, result)
    for run in runs:
        print(f"context {run['context']}: {run['decode_tok_s']} tok/s, blocks held: full "
              f"{run['full_blocks_held']}, sliding {run['window_blocks_held']}")
    print(f"{args.long} over {args.short}: {result['long_over_short']}x")
    return result


if __name__ == "__main__":
    main()
