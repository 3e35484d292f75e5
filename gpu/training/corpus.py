"""Tiny Shakespeare as training material: the fixed train / held-out split and the speeches.

The file is a run of blocks separated by blank lines; each block is a speaker's name with a
colon on its first line and the speech on the lines below. The held-out part is the last 10 %
of the characters, from ``int(len(text) * 0.9)`` on, and is never trained on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

HELD_OUT_FRACTION = 0.1


@dataclass(frozen=True)
class Speech:
    speaker: str
    text: str


@dataclass(frozen=True)
class Split:
    train: str
    held_out: str


def read_split(path: str | Path) -> Split:
    """The text at ``path`` cut at ``int(len(text) * 0.9)``."""
    text = Path(path).read_text(encoding="utf-8")
    cut = int(len(text) * (1.0 - HELD_OUT_FRACTION))
    return Split(train=text[:cut], held_out=text[cut:])


def parse_speeches(text: str) -> list[Speech]:
    """Every well-formed ``Speaker:\\nspeech`` block of ``text``, in order."""
    speeches = []
    for block in text.split("\n\n"):
        head, _, body = block.strip("\n").partition("\n")
        body = body.strip()
        if head.endswith(":") and body and len(head) < 40:
            speeches.append(Speech(speaker=head[:-1].strip(), text=body))
    return speeches
