"""Whether a draft model can propose tokens to a target: the same vocabulary, token for token
(``gpu/draft_runner.py``)."""

from __future__ import annotations

import json
from pathlib import Path

from tidal.gpu.model_config import ModelConfig


def check_compatible(target: ModelConfig, draft: ModelConfig, target_dir: str,
                     draft_dir: str) -> None:
    """A clear error unless the draft shares the target's vocabulary (size, and token ids
    where both folders hold a ``tokenizer.json``)."""
    if target.vocab_size != draft.vocab_size:
        raise ValueError(f"the draft model {draft_dir!r} has a vocabulary of "
                         f"{draft.vocab_size} tokens, the target {target_dir!r} of "
                         f"{target.vocab_size}: a draft must share the target's tokenizer")
    mine, theirs = _vocab(target_dir), _vocab(draft_dir)
    if mine is not None and theirs is not None and mine != theirs:
        differ = sorted(t for t in set(mine) | set(theirs) if mine.get(t) != theirs.get(t))
        raise ValueError(f"the draft model {draft_dir!r} and the target {target_dir!r} have "
                         f"different tokenizers ({len(differ)} tokens differ, e.g. "
                         f"{differ[:3]}): a draft must share the target's tokenizer")


def _vocab(model_dir: str) -> dict[str, int] | None:
    """A folder's ``tokenizer.json`` token ids, added tokens included; None without one."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    raw = json.loads(path.read_text(encoding="utf-8"))
    vocab = dict(raw.get("model", {}).get("vocab") or {})
    vocab.update({t["content"]: t["id"] for t in raw.get("added_tokens", [])})
    return vocab
