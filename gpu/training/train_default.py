"""Train the embedded default model: a small Llama on Tiny Shakespeare, on a CPU.

    python -m tidal.gpu.training.train_default --data PATH/tinyshakespeare.txt \
        --out core/default_model

Its speculative-decoding draft (docs/speculative-decoding.md) is trained the same way on the
same text, reusing the model's tokenizer (so the two share the vocabulary), in a smaller shape:

    python -m tidal.gpu.training.train_default --data PATH/tinyshakespeare.txt \
        --out core/default_model/draft --tokenizer core/default_model \
        --hidden-size 64 --intermediate-size 176 --num-layers 2 --num-heads 2 \
        --num-kv-heads 2 --steps 1800 --lr 3e-3 --eval-every 300 --threads 1

Reproducible: a fixed seed drives the weights and every batch, and the tokenizer's training is
deterministic (results can still differ in the last bits with the number of threads). The last
10 % of the text is held out. Every ``--eval-every`` steps a line gives the mean training loss
(nats per token, plain text and chats mixed) and the loss on the first 30,000 held-out
characters (nats per character); the end gives the loss on all of the held-out text.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TypeVar

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tidal.gpu.training.corpus import parse_speeches, read_split
from tidal.gpu.training.examples import ExampleSampler, MixConfig
from tidal.gpu.training.heldout import nats_per_char
from tidal.gpu.training.tokenizer import EOS, train_tokenizer

T = TypeVar("T")
MONITOR_CHARS = 30_000  # held-out characters scored at each evaluation during training


@dataclass
class TrainConfig:
    data: str
    out: str
    seed: int = 0
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 704
    num_layers: int = 6
    num_heads: int = 8
    num_kv_heads: int = 8
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 700
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    chat_fraction: float = 0.5
    eval_every: int = 50
    threads: int = 2
    bf16_autocast: bool = False
    tokenizer: str = ""  # a saved tokenizer to reuse (a draft's: its target's); "": train one


def parse_config(cls: type[T], description: str, required: tuple[str, ...],
                 argv: list[str] | None = None) -> T:
    """A training config dataclass from the command line: a flag per field (``--lr``),
    ``required`` ones without a default, booleans as switches."""
    parser = argparse.ArgumentParser(description=description)
    for f in fields(cls):  # type: ignore[arg-type]
        name = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            parser.add_argument(name, action="store_true")
        elif f.name in required:
            parser.add_argument(name, required=True)
        else:
            parser.add_argument(name, type=type(f.default), default=f.default)
    return cls(**vars(parser.parse_args(argv)))


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    return parse_config(TrainConfig, __doc__.split("\n\n")[0], ("data", "out"), argv)


def build_model(cfg: TrainConfig, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.seq_len, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(config)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norm gains)."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": cfg.weight_decay},
              {"params": vectors, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then a cosine down to ``min_lr_ratio * lr`` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def train_step(model: LlamaForCausalLM, optimizer: torch.optim.AdamW, batch: torch.Tensor,
               cfg: TrainConfig, lr: float) -> float:
    for group in optimizer.param_groups:
        group["lr"] = lr
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16_autocast):
        loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def held_out_loss(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, text: str,
                  cfg: TrainConfig) -> float:
    model.eval()
    value = nats_per_char(model, tokenizer, text, cfg.seq_len)
    model.train()
    return value


def train(cfg: TrainConfig) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    torch.set_num_threads(cfg.threads)
    split = read_split(cfg.data)
    tokenizer = (PreTrainedTokenizerFast.from_pretrained(cfg.tokenizer) if cfg.tokenizer
                 else train_tokenizer(split.train, cfg.vocab_size))
    mix = MixConfig(seq_len=cfg.seq_len, chat_fraction=cfg.chat_fraction)
    sampler = ExampleSampler(tokenizer, split.train, parse_speeches(split.train), mix, cfg.seed)
    model = build_model(cfg, tokenizer)
    optimizer = make_optimizer(model, cfg)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{num_params / 1e6:.2f}M parameters, {len(tokenizer)} tokens in the vocabulary, "
          f"{len(sampler.text_ids)} training tokens of plain text", flush=True)
    monitor = split.held_out[:MONITOR_CHARS]
    start, losses = time.perf_counter(), []
    for step in range(cfg.steps):
        losses.append(train_step(model, optimizer, sampler.batch(cfg.batch_size), cfg,
                                 lr_at(step, cfg)))
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            elapsed = time.perf_counter() - start
            tokens = (step + 1) * cfg.batch_size * cfg.seq_len
            print(f"step {step + 1:5d}/{cfg.steps}  lr {lr_at(step, cfg):.2e}  "
                  f"train {sum(losses) / len(losses):.3f} nats/token  "
                  f"held-out {held_out_loss(model, tokenizer, monitor, cfg):.3f} nats/char  "
                  f"{tokens / elapsed:.0f} tokens/s  {elapsed:.0f} s", flush=True)
            losses = []
    held_out = held_out_loss(model, tokenizer, split.held_out, cfg)
    print(f"done in {time.perf_counter() - start:.0f} s; held-out (all of it, float32): "
          f"{held_out:.4f} nats/char", flush=True)
    return model, tokenizer


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """A standard HF directory: bf16 weights, tokenizer with its chat template, and
    generation defaults that stop on ``<|end|>``."""
    out.mkdir(parents=True, exist_ok=True)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id, do_sample=True, temperature=0.8, top_p=0.95)
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.model_max_length = model.config.max_position_embeddings
    tokenizer.save_pretrained(out, save_jinja_files=False)  # the template inside tokenizer_config
    for path in out.iterdir():
        path.chmod(0o644)  # safetensors writes its file readable by its owner only


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    model, tokenizer = train(cfg)
    save(model, tokenizer, Path(cfg.out))
    print(f"saved to {cfg.out}", flush=True)


if __name__ == "__main__":
    main()
