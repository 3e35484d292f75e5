"""The draft's distillation (gpu/training/distill_draft.py): labels fall on the target's replies
only, the replies are the target's greedy tokens (HF's forward agrees with every one), and a
short run writes a draft the draft runner accepts."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tidal.core.config import DEFAULT_MODEL
from tidal.gpu.draft_vocab import check_compatible
from tidal.gpu.model_config import ModelConfig
from tidal.gpu.training import distill_draft
from tidal.gpu.training.distill_draft import IGNORE, agreement, batch_of, continue_greedily

SPEECHES = ["Speak, speak.", "You are all resolved rather to die than to famish?",
            "Resolved. resolved.", "First, you know Caius Marcius is chief enemy to the people.",
            "We know't, we know't.", "Let us kill him, and we'll have corn at our own price."]


def _play(path: Path) -> Path:
    blocks = [f"{'FIRST' if i % 2 else 'SECOND'} CITIZEN:\n{SPEECHES[i % len(SPEECHES)]}"
              for i in range(400)]
    path.write_text("\n\n".join(blocks) + "\n")
    return path


def test_labels_fall_on_replies_only() -> None:
    ids, mask, labels = batch_of([[7, 8, 9, 10], [7, 8, 9]], [2, 1], pad=1)
    assert ids.tolist() == [[7, 8, 9, 10], [7, 8, 9, 1]]
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert labels.tolist() == [[IGNORE, IGNORE, 9, 10], [IGNORE, 8, 9, IGNORE]]


def test_replies_are_the_targets_greedy_tokens() -> None:
    prompts = [[0, 100 + i, 200 + 3 * i, 300] for i in range(6)]
    rows = continue_greedily(str(DEFAULT_MODEL), prompts, 24)
    assert [r[:4] for r in rows] == prompts and all(len(r) == 28 for r in rows)
    target = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32)
    assert agreement(target, rows, [4] * len(rows), pad=1) >= 0.98


def test_a_short_run_writes_a_draft_the_runner_takes(tmp_path: Path) -> None:
    draft = Path(DEFAULT_MODEL) / "draft"
    out = tmp_path / "draft"
    distill_draft.main(["--data", str(_play(tmp_path / "play.txt")), "--target",
                        str(DEFAULT_MODEL), "--draft", str(draft), "--out", str(out),
                        "--num-sequences", "16", "--reply-len", "12", "--max-prompt", "24",
                        "--steps", "3", "--batch-size", "4", "--eval-every", "3"])
    check_compatible(ModelConfig.load(str(DEFAULT_MODEL)), ModelConfig.load(str(out)),
                     str(DEFAULT_MODEL), str(out))
    before = AutoModelForCausalLM.from_pretrained(draft).state_dict()
    after = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # it trained
