"""Fine-tune a speculative-decoding draft on its target's own greedy replies.

A draft pays in proportion to how often its guess is the target's next token, and the target's
greedy text is not the training text: it is narrower and repeats itself. So the draft learns
from what the target writes (sequence-level distillation): prompts from the training text,
plain windows and chats as the target was trained on, each continued greedily by the target,
and the draft trained on those continuations (the prompt's tokens give context, not loss).

    python -m tidal.gpu.training.distill_draft --data PATH/tinyshakespeare.txt \
        --target core/default_model --draft core/default_model/draft \
        --out core/default_model/draft

Every ``--eval-every`` steps, and at the end, a line gives the draft's agreement with the
target on held-out prompts: the share of the target's greedy tokens that the draft's argmax
matches, given the same context (the chance a proposal is accepted).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from tidal.gpu.training.corpus import parse_speeches, read_split
from tidal.gpu.training.examples import ExampleSampler, MixConfig
from tidal.gpu.training.train_default import parse_config

IGNORE = -100  # the label HF's loss skips


@dataclass
class DistillConfig:
    data: str
    target: str
    draft: str
    out: str
    seed: int = 0
    num_sequences: int = 3072  # teacher continuations made up front
    reply_len: int = 128
    min_prompt: int = 8
    max_prompt: int = 96
    steps: int = 1200
    batch_size: int = 32
    lr: float = 2e-3
    eval_every: int = 200
    threads: int = 2


def parse_args(argv: list[str] | None = None) -> DistillConfig:
    return parse_config(DistillConfig, __doc__.split("\n\n")[0],
                        ("data", "target", "draft", "out"), argv)


def prompts(sampler: ExampleSampler, rng: random.Random, num: int, cfg: DistillConfig
            ) -> list[list[int]]:
    """Half plain-text windows, half chats, each cut at a random length."""
    out = []
    for _ in range(num):
        row = sampler.plain() if rng.random() < 0.5 else sampler.chat()
        out.append(row[:rng.randint(cfg.min_prompt, cfg.max_prompt)])
    return out


def continue_greedily(target: str, prompts_: list[list[int]], reply_len: int
                      ) -> list[list[int]]:
    """Each prompt followed by ``reply_len`` of the target's greedy tokens, run by tidal's
    own engine in float32 (it runs on past EOS: a reply's end is a place to agree on too)."""
    from tidal.core import LLM, SamplingParams

    llm = LLM(target, dtype="float32", max_num_seqs=64)
    params = SamplingParams(temperature=0.0, max_tokens=reply_len, ignore_eos=True,
                            detokenize=False)
    outs = llm.generate(prompts_, params, use_tqdm=False)
    llm.shutdown()
    return [p + list(o.outputs[0].token_ids) for p, o in zip(prompts_, outs)]


def batch_of(rows: list[list[int]], prompt_lens: list[int], pad: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, their mask, and labels on the replies only."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad)
    labels = torch.full((len(rows), width), IGNORE)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for j, (row, n) in enumerate(zip(rows, prompt_lens)):
        ids[j, :len(row)] = torch.tensor(row)
        mask[j, :len(row)] = 1
        labels[j, n:len(row)] = torch.tensor(row[n:])
    return ids, mask, labels


@torch.no_grad()
def agreement(draft: PreTrainedModel, rows: list[list[int]], prompt_lens: list[int],
              pad: int) -> float:
    """The share of reply tokens the draft's argmax predicts."""
    draft.eval()
    ids, mask, labels = batch_of(rows, prompt_lens, pad)
    guess = draft(input_ids=ids, attention_mask=mask).logits.argmax(-1)
    draft.train()
    target = labels[:, 1:]
    scored = target != IGNORE
    return float(((guess[:, :-1] == target) & scored).sum() / scored.sum())


def distill(cfg: DistillConfig) -> PreTrainedModel:
    torch.set_num_threads(cfg.threads)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(cfg.target)
    pad = tokenizer.pad_token_id
    split = read_split(cfg.data)
    rng = random.Random(cfg.seed)
    mix = MixConfig(seq_len=cfg.max_prompt + 1)
    train_src = ExampleSampler(tokenizer, split.train, parse_speeches(split.train), mix, cfg.seed)
    held_src = ExampleSampler(tokenizer, split.held_out, parse_speeches(split.held_out), mix,
                              cfg.seed + 1)
    start = time.perf_counter()
    train_prompts = prompts(train_src, rng, cfg.num_sequences, cfg)
    held_prompts = prompts(held_src, rng, 64, cfg)
    rows = continue_greedily(cfg.target, train_prompts + held_prompts, cfg.reply_len)
    train_rows, held_rows = rows[:len(train_prompts)], rows[len(train_prompts):]
    print(f"{len(train_rows)} teacher replies in {time.perf_counter() - start:.0f} s", flush=True)
    train_lens, held_lens = list(map(len, train_prompts)), list(map(len, held_prompts))
    draft = AutoModelForCausalLM.from_pretrained(cfg.draft, dtype=torch.float32).train()
    print(f"agreement before: {agreement(draft, held_rows, held_lens, pad):.3f}", flush=True)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                  weight_decay=0.0)
    for step in range(cfg.steps):
        for group in optimizer.param_groups:  # a short warm-up, then linear decay
            group["lr"] = cfg.lr * min(1.0, (step + 1) / 50) * (1.0 - 0.9 * step / cfg.steps)
        pick = [rng.randrange(len(train_rows)) for _ in range(cfg.batch_size)]
        ids, mask, labels = batch_of([train_rows[i] for i in pick],
                                     [train_lens[i] for i in pick], pad)
        loss = draft(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            print(f"step {step + 1}/{cfg.steps} loss {loss.item():.3f} agreement "
                  f"{agreement(draft, held_rows, held_lens, pad):.3f} "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
    return draft


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    draft = distill(cfg)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(cfg.draft)
    draft.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out, save_jinja_files=False)
    for path in out.iterdir():
        path.chmod(0o644)
    print(f"saved to {out}", flush=True)


if __name__ == "__main__":
    main()
